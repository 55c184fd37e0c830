"""What every route of the dashboard stands on: the App it shows, its ``access`` rules, whether
actions are on, and the one checked way of reading a request (a query parameter, a POSTed form and
its CSRF token). Apart so that the routes that read (``server``), the routes that change things
(``actions``) and the sign-in routes (``signin``) each live in a module of their own and still read
a request the same way, checked before any statement is sent."""

from __future__ import annotations

from urllib.parse import parse_qs

from starlette.exceptions import HTTPException
from starlette.requests import Request

from .._core.checks import MAX_ID_BYTES, check_text
from ..app import App
from .access import CSRF_COOKIE, Access, same_origin
from .data import Reader

MAX_BODY = 16 * 1024  # bytes of a POST: a form of a few fields


class Routes:
    """The state the dashboard's routes share, over one App, and their checked reading of a request."""

    def __init__(self, app: App, access: Access, allow_actions: bool) -> None:
        self.app = app
        self.access = access
        self.allow_actions = allow_actions
        self.reader = Reader(app)

    @staticmethod
    def _text(request: Request, name: str, limit: int, required: bool = False) -> str | None:
        values = request.query_params.getlist(name)
        if len(values) > 1:
            raise HTTPException(400, f"{name} is given once")
        value = values[0] if values else ""
        if not value:
            if required:
                raise HTTPException(400, f"{name} is required")
            return None
        try:
            return check_text(value, name, limit)
        except ValueError as exc:
            raise HTTPException(400, str(exc)) from None

    def _id(self, request: Request) -> str:
        value = self._text(request, "id", MAX_ID_BYTES, required=True)
        assert value is not None
        return value

    def csrf(self, request: Request) -> str:
        return self.access.csrf_token(request.scope.get("pgflow.csrf_cookie") or "")

    async def _form(self, request: Request) -> dict[str, str]:
        """A POSTed form from this server's own page: bounded, urlencoded, each field once."""
        if not same_origin({k.lower(): v for k, v in request.headers.items()}):
            raise HTTPException(403, "a request from another site's page")
        if request.headers.get("content-type", "").partition(";")[0].strip().lower() != \
                "application/x-www-form-urlencoded":
            raise HTTPException(415, "send a form (application/x-www-form-urlencoded)")
        declared = request.headers.get("content-length")
        if declared is not None and (len(declared) > 9 or not declared.isdigit() or int(declared) > MAX_BODY):
            raise HTTPException(413, f"a form is at most {MAX_BODY} bytes")
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > MAX_BODY:
                raise HTTPException(413, f"a form is at most {MAX_BODY} bytes")
        try:
            fields = parse_qs(body.decode("utf-8"), keep_blank_values=True, strict_parsing=False, max_num_fields=10)
        except (UnicodeDecodeError, ValueError):
            raise HTTPException(400, "not a form") from None
        if any(len(v) > 1 for v in fields.values()):
            raise HTTPException(400, "each field is given once")
        return {k: v[0] for k, v in fields.items()}

    def _checked_post(self, request: Request, form: dict[str, str]) -> None:
        if not self.access.csrf_ok(request.scope.get("pgflow.cookies", {}).get(CSRF_COOKIE), form.get("csrf", "")):
            raise HTTPException(403, "the form's CSRF token does not match this browser's: reload the page and try"
                                     " again")
