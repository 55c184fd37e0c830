"""The dashboard's actions: the routes that change things (cancel, resume or fork a workflow; pause
or resume a queue), each behind a confirmation page or a button of the dashboard's own pages. Apart
from the routes that only read (``server``) because these are the ones a stranger must never reach:
each is off unless the dashboard was started with --allow-actions (which needs a token), and each
POST must carry this browser's CSRF token from a page of this server."""

from __future__ import annotations

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response

from .._core.checks import POSITION_LIMIT
from ..errors import CannotResume, UnknownWorkflow
from .markup import path
from .pages import confirm_page
from .routes import Routes


class Actions(Routes):
    """The routes that change things; ``server.Dashboard`` serves them with the rest."""

    def _actions_on(self) -> None:
        if not self.allow_actions:
            raise HTTPException(403, "actions are off: start the dashboard with --allow-actions")

    async def confirm(self, request: Request) -> Response:
        self._actions_on()
        workflow_id = self._id(request)
        action = self._text(request, "action", 10, required=True)
        if action not in ("cancel", "resume", "fork"):
            raise HTTPException(400, "action is cancel, resume or fork")
        detail = await self.reader.workflow(workflow_id)
        if detail is None:
            raise HTTPException(404, f"no workflow with id {workflow_id!r}")
        steps = detail.steps[-1].position + 1 if detail.steps else 0
        return HTMLResponse(confirm_page(workflow_id, action, self.csrf(request), steps, None))

    async def act(self, request: Request) -> Response:
        self._actions_on()
        form = await self._form(request)
        self._checked_post(request, form)
        action = form.get("action")
        try:
            handle = self.app.handle(form.get("id", ""))
        except ValueError as exc:
            raise HTTPException(400, str(exc)) from None
        try:
            if action == "cancel":
                await handle.cancel_async()
            elif action == "resume":
                await handle.resume_async()
            elif action == "fork":
                step = form.get("from_step", "")
                if not (step.isascii() and step.isdigit() and len(step) <= 10 and int(step) < POSITION_LIMIT):
                    raise HTTPException(400, "from_step is a journal position, a number from 0")
                handle = await handle.fork_async(int(step))
            else:
                raise HTTPException(400, "action is cancel, resume or fork")
        except UnknownWorkflow:
            raise HTTPException(404, f"no workflow with id {handle.id!r}") from None
        except CannotResume as exc:
            raise HTTPException(409, str(exc)) from None
        return RedirectResponse(path("workflow", id=handle.id), status_code=303)

    async def queue_act(self, request: Request) -> Response:
        """Pause or resume a queue (the overview's buttons)."""
        self._actions_on()
        form = await self._form(request)
        self._checked_post(request, form)
        action, queue = form.get("action"), form.get("queue", "")
        if action not in ("pause", "resume"):
            raise HTTPException(400, "action is pause or resume")
        try:
            if action == "pause":
                await self.app.pause_queue_async(queue)
            else:
                await self.app.resume_queue_async(queue)
        except (ValueError, TypeError) as exc:
            raise HTTPException(400, str(exc)) from None
        self.reader.changed()
        return RedirectResponse("/", status_code=303)
