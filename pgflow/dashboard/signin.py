"""Signing in and out: the login form that turns the dashboard's token into a session of its own
(a random id this process keeps), the sign-out that ends it on the server, and the answer to a
request without the token. Apart from the pages (``server``) because this is where a token is
checked against guesses (counted per client address) and where session cookies are set and
cleared; ``access`` holds the rules, this module the routes."""

from __future__ import annotations

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import HTMLResponse, PlainTextResponse, RedirectResponse, Response

from .access import SESSION_COOKIE, Receive, Scope, Send, client_of, cookie_header
from .pages import login_page, logout_page
from .routes import Routes


class SignIn(Routes):
    """The sign-in routes and the refusal of a request without the token; ``server.Dashboard``
    serves them with the rest."""

    async def login(self, request: Request) -> Response:
        """The sign-in form; a right token starts a session of its own (a random id this process
        keeps, with its expiry), a wrong one counts against the client's address."""
        if self.access.token is None:
            return RedirectResponse("/", status_code=303)
        if request.method == "GET":
            return HTMLResponse(login_page(None, self.csrf(request)))
        form = await self._form(request)
        self._checked_post(request, form)
        client = client_of(request.scope)
        wait = self.access.attempts.blocked(client)
        if wait > 0:
            raise HTTPException(429, "too many wrong tokens from this address: try again in a minute",
                                headers={"Retry-After": str(int(wait) + 1)})
        if not self.access.login(form.get("token", "")):
            self.access.attempts.failed(client)
            return HTMLResponse(login_page("That is not the token.", self.csrf(request)), status_code=401)
        self.access.end_session(request.scope.get("pgflow.cookies", {}).get(SESSION_COOKIE))
        response = RedirectResponse("/", status_code=303)
        response.headers.append("set-cookie", cookie_header(
            SESSION_COOKIE, self.access.start_session(), request.url.scheme == "https",
            int(self.access.session_seconds)).decode())
        return response

    async def logout(self, request: Request) -> Response:
        """Ends this browser's session here, on the server: the cookie, wherever it was copied, no
        longer signs anyone in. (GET shows the button: a sign-out is a POST with this page's CSRF.)"""
        if request.method == "GET":
            return HTMLResponse(logout_page(self.csrf(request)))
        form = await self._form(request)
        self._checked_post(request, form)
        self.access.end_session(request.scope.get("pgflow.cookies", {}).get(SESSION_COOKIE))
        response = RedirectResponse("/login", status_code=303)
        response.headers.append("set-cookie", cookie_header(SESSION_COOKIE, "", request.url.scheme == "https", 0)
                                .decode())
        return response

    async def refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The answer to a request without the token: the login form for a page, a bare 401 else."""
        request = Request(scope, receive)
        headers = {"WWW-Authenticate": 'Bearer realm="pgflow dashboard"'}
        response: Response
        if request.method == "GET" and "text/html" in request.headers.get("accept", ""):
            csrf = self.access.csrf_token(scope.get("pgflow.csrf_cookie") or "")
            response = HTMLResponse(login_page(None, csrf), status_code=401, headers=headers)
        else:
            response = PlainTextResponse("this dashboard needs its token: Authorization: Bearer <token>, or sign in"
                                         " at /login", status_code=401, headers=headers)
        await response(scope, receive, send)
