"""The dashboard's pages about workflows (the list, a workflow, its actions' confirmation) and the
small ones (sign-in, sign-out, errors), rendered on the server: each reads without JavaScript (the
script only keeps the live parts live), and each part a live connection refreshes is a function of its
own. The overview, the fleet's page, is in ``overview``."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from .._core.status import Status
from .data import (
    BIG_VALUE,
    TAIL,
    Detail,
    Message,
    Page,
    Relative,
    Value,
)
from .markup import Html, esc, join, link, page, path, seconds, shown_value, status, table, tag, when

STATUSES = tuple(s.value for s in Status)  # plain strings: the filter's options
ENDED = (Status.SUCCEEDED, Status.FAILED, Status.CANCELLED)
WAITING_STATUSES = (Status.QUEUED, Status.RUNNING)  # a workflow that may still wait for a message


def workflow_link(workflow_id: str, text: str | None = None) -> Html:
    return link(path("workflow", id=workflow_id), text if text is not None else workflow_id, class_="id")


# -- the list ---------------------------------------------------------------------------------------------


def list_page(result: Page, query: dict[str, str], next_href: str | None, first_href: str | None) -> Html:
    form = tag("form", tag("label", "status ", tag("select", tag("option", "any", value=""), *(
        tag("option", s, value=s, selected=query.get("status") == s) for s in STATUSES), name="status")),
        tag("label", "name ", tag("input", name="name", value=query.get("name", ""))),
        tag("label", "queue ", tag("input", name="queue", value=query.get("queue", ""))),
        tag("label", "created after ", tag("input", name="since", value=query.get("since", ""),
                                          placeholder="1h, 7d or 2026-12-01T10:00Z")),
        tag("label", "before ", tag("input", name="before", value=query.get("before", ""),
                                    placeholder="ISO time")),
        tag("button", "Filter", type="submit"), method="get", action="/workflows", class_="filters")
    rows = [[workflow_link(r.id), r.name, r.queue, status(r.status), r.attempt, when(r.created_at),
             seconds((r.finished_at - r.started_at).total_seconds()) if r.finished_at and r.started_at else "-",
             join([tag("code", r.error_type) if r.error_type else "", " ", (r.error_message or "")[:160]])]
            for r in result.rows]
    notes = []
    if result.scanned_short:
        notes.append(tag("p", "This page read as far as its bound and found no more rows: the next page goes on"
                              " from where it stopped (older rows may still match).", class_="note"))
    pager = tag("p", link(first_href, "« newest") if first_href else "", " ",
                link(next_href, "older »", rel="next") if next_href else tag("span", "(no older rows)"),
                class_="pager")
    return page("Workflows", join([form, table(["id", "name", "queue", "status", "attempt", "created", "ran for",
                                                "error"], rows, "no workflow matches", id="workflows"),
                                   *notes, pager]), nav="workflows")


# -- a workflow -------------------------------------------------------------------------------------------


def _value(v: Value, limit: int, arguments: bool = False) -> Html:
    if not v.shown:
        return tag("p", "none" if v.size is None else f"{v.size:,} bytes encoded: over the {limit:,} bytes shown",
                   class_="empty")
    value = v.value
    # Started by name, arguments are stored as [positional, by name]; a checked call, by parameter.
    if arguments and isinstance(value, list) and len(value) == 2 and isinstance(value[0], list) \
            and isinstance(value[1], dict):
        value = {"args": value[0], "kwargs": value[1]} if value[1] else {"args": value[0]}
    return tag("pre", shown_value(value), class_="value")


def _inline(v: Value) -> Html:
    if not v.shown:
        return esc("-" if v.size is None else f"({v.size:,} bytes)")
    text = shown_value(v.value, 400)
    return tag("code", text if len(text) < 400 else text[:400] + "...")


def _error(error: dict[str, Any] | None) -> Html:
    if not error:
        return esc("")
    return tag("div", tag("p", tag("strong", str(error.get("type", "Exception"))), ": ", str(error.get("message", ""))),
               tag("pre", str(error.get("traceback", "")), class_="traceback") if error.get("traceback") else "",
               class_="error-box")


def workflow_page(d: Detail, tails: dict[str, list[tuple[int, Value]]], *, actions: bool) -> Html:
    r = d.record
    state = tag("div", workflow_state(d, actions), id="state", data_live=path("live", "workflow", id=r["id"]),
                data_streams=",".join(s.key for s in d.streams), data_status=r["status"])
    return page(f"Workflow {r['id']}", join([state, _streams(d, tails)]), nav="workflows",
                refresh_note="Live: status, steps, events and messages refresh while the workflow runs; streams"
                             " grow as they are written. Without JavaScript, reload.")


def _actions(d: Detail) -> Html:
    r = d.record
    items = []
    if r["status"] not in ENDED:
        items.append(link(path("confirm", id=r["id"], action="cancel"), "Cancel", class_="button danger",
                          id="action-cancel"))
    if r["status"] in (Status.FAILED, Status.CANCELLED):
        items.append(link(path("confirm", id=r["id"], action="resume"), "Resume", class_="button",
                          id="action-resume"))
    items.append(link(path("confirm", id=r["id"], action="fork"), "Fork…", class_="button", id="action-fork"))
    return tag("p", *items, class_="actions")


def workflow_state(d: Detail, actions: bool) -> Html:
    """The parts of a workflow's page that change while it runs."""
    r = d.record
    head = tag("p", status(r["status"]), " ", tag("code", r["name"]), " on queue ", tag("code", r["queue"]),
               class_="lead")
    buttons = _actions(d) if actions else tag(
        "p", "Actions are off: start the dashboard with --allow-actions to cancel, resume or fork.", class_="note")
    ran = (r["finished_at"] or d.now) - r["started_at"] if r["started_at"] else None
    facts = [
        ("status", status(r["status"])), ("attempt", f"{r['attempt']} (claims: {r['claims']})"),
        ("created", when(r["created_at"])), ("started", when(r["started_at"])), ("finished", when(r["finished_at"])),
        ("ran for", seconds(ran.total_seconds()) if ran is not None else "-"),
        ("due", when(r["due_at"]) if r["status"] == Status.QUEUED else "-"),
        # (the row keeps the topic it last waited for: only a workflow not yet ended waits)
        ("waiting for", r["waiting_for"] if r["waiting_for"] and r["status"] in WAITING_STATUSES else "-"),
        ("priority", r["priority"]),
        ("max attempts", "unlimited" if r["max_attempts"] is None else r["max_attempts"]),
        ("timeout", seconds(r["timeout"])), ("deadline", when(r["deadline_at"])),
        ("lease", join([tag("code", r["lease_owner"]), " until ", when(r["lease_expires_at"])])
         if r["lease_owner"] else "-"),
        ("cancel requested", "yes" if r["cancel_requested"] else "no"),
        ("trace", tag("code", r["traceparent"]) if r["traceparent"] else "-"),
    ]
    record = tag("dl", *(join([tag("dt", k), tag("dd", v)]) for k, v in facts), class_="facts", id="record")
    parts = [head, buttons]
    if d.error:
        parts.append(tag("section", tag("h2", "Error"), _error(d.error), id="error"))
    values = [tag("h2", "Arguments"), _value(d.arguments, BIG_VALUE, arguments=True)]
    if r["status"] == Status.SUCCEEDED or d.result.size is not None:
        values += [tag("h2", "Result"), tag("div", _value(d.result, BIG_VALUE), id="result")]
    parts.append(tag("div", tag("section", tag("h2", "Record"), record),
                     tag("section", *values, id="arguments"), class_="columns"))
    parts.append(_timeline(d))
    parts.append(_events(d))
    parts.append(_messages("Messages received", d.received, "received"))
    parts.append(_messages("Messages sent by its body", d.sent, "sent"))
    parts.append(_family(d))
    return join(parts)


def _timeline(d: Detail) -> Html:
    rows: list[list[object]] = []
    for s in d.steps:
        kind = "sleep" if s.name == "pgflow.sleep" else "receive" if s.name.startswith("pgflow.recv:") else (
            "event" if s.name.startswith("pgflow.set_event:") else "step")
        what: object = _inline(s.output)
        if kind == "sleep":
            what = join(["until ", when(s.wake_at)])
        elif kind == "receive" and s.waiting:
            what = join(["waiting, until ", when(s.wake_at)])
        took = seconds(s.duration_s) if s.duration_s is not None else join([
            seconds(s.since_previous_s), tag("span", " (since the previous entry)", class_="note")])
        errors = [tag("div", tag("span", f"attempt {e.get('step_attempt')} of run {e.get('run')}: ", class_="note"),
                      _error(e)) for e in s.retried_errors]
        rows.append([s.position, tag("code", s.name), kind, when(s.started_at), when(s.finished_at), took, s.attempts,
                     tag("span", "failed", class_="status status-failed") if s.error else "ok", what,
                     join([*errors, _error(s.error) if s.error else ""])])
    running = [tag("li", f"position {p}: {n} attempt(s) started", " at " if at else "", when(at) if at else "",
                   ", not recorded yet") for p, (n, at) in sorted(d.tries_under_way.items())]
    more = tag("p", "Only the first steps are shown.", class_="note") if d.more_steps else ""
    return tag("section", tag("h2", "Steps"),
               table(["#", "name", "kind", "started", "recorded", "took", "attempts", "outcome", "output",
                      "errors (each failed attempt)"], rows, "no journal entry yet", id="steps", class_="steps"),
               tag("ul", *running, id="under-way") if running else "", more,
               tag("p", "A step's time runs from its first attempt's start to its record; entries without a"
                        " start (sleeps, events, steps recorded before pgflow noted starts) show the time since"
                        " the previous entry's record.", class_="note"))


def _events(d: Detail) -> Html:
    rows = [[tag("code", key), _inline(value), when(at)] for key, value, at in d.events]
    return tag("section", tag("h2", "Events"), table(["key", "value", "set"], rows, "no event set", id="events"))


def _messages(title: str, messages: list[Message], id_: str) -> Html:
    rows = [[m.id, tag("code", m.topic), _inline(m.value), workflow_link(m.to) if id_ == "sent" else
             tag("code", m.idempotency_key or "-"), when(m.sent_at),
             join(["at position ", str(m.consumed_position), ", ", when(m.consumed_at)]) if m.consumed_at else "unread"]
            for m in messages]
    return tag("section", tag("h2", title), table(["#", "topic", "value", "to" if id_ == "sent" else "key", "sent",
                                                    "received"], rows, "none", id=f"messages-{id_}"))


def _family(d: Detail) -> Html:
    def item(rel: Relative, current: bool = False) -> Html:
        return tag("span", workflow_link(rel.id) if not current else tag("strong", rel.id), " ", tag("code", rel.name),
                   " ", status(rel.status))

    up = [tag("li", item(a)) for a in d.ancestors]
    children: dict[str | None, list[Relative]] = {}
    for rel in d.descendants:
        children.setdefault(rel.parent_id, []).append(rel)

    def tree(parent: str, seen: frozenset[str]) -> Html:
        kids = children.get(parent, [])
        if not kids or parent in seen:
            return esc("")
        return tag("ul", *(tag("li", item(k), tree(k.id, seen | {parent})) for k in kids))

    me = Relative(d.record["id"], d.record["name"], d.record["status"], 0)
    body = tag("ul", *up, tag("li", item(me, current=True), tree(me.id, frozenset())), class_="tree", id="family")
    return tag("section", tag("h2", "Parent and children"), body if (up or d.descendants) else tag(
        "p", "no parent, no children", class_="empty"))


def _streams(d: Detail, tails: dict[str, list[tuple[int, Value]]]) -> Html:
    if not d.streams:
        return tag("section", tag("h2", "Streams"), tag("p", "no stream", class_="empty"), id="streams")
    boxes = []
    for s in d.streams:
        first = max(0, s.length - TAIL)
        items = tails.get(s.key)
        if items is None:  # not read for the page: the live part starts at the tail
            items = []
        else:
            first = items[0][0] if items else first
        upto = first + len(items)
        boxes.append(tag(
            "div", tag("h3", tag("code", s.key), " ", tag("span", f"{s.length:,} chunks", class_="length"),
                       " · ", tag("span", "closed" if s.closed else "open", class_="state")),
            tag("p", f"showing from position {first:,}" if first else "", class_="note"),
            tag("ol", stream_items(items), start=str(first)),  # numbered by position, from 0
            class_="stream", data_key=s.key, data_next=str(upto),
            data_src=path("live", "stream", id=d.record["id"], key=s.key)))
    return tag("section", tag("h2", "Streams"), *boxes, id="streams")


def stream_items(items: list[tuple[int, Value]]) -> Html:
    """The chunks a stream's box shows before its live connection takes over."""
    return join(tag("li", stream_text(v), data_pos=str(p)) for p, v in items if v.size is not None)


def stream_text(v: Value) -> str:
    if not v.shown:
        return f"({v.size:,} bytes)"
    return v.value if isinstance(v.value, str) else shown_value(v.value, 4000)


# -- the rest ---------------------------------------------------------------------------------------------


def confirm_page(workflow_id: str, action: str, csrf: str, steps: int, from_step: int | None) -> Html:
    what = {"cancel": "Cancel this workflow? A queued one never runs; a running one stops at its worker's next"
                      " heartbeat; the workflows its body started are cancelled with it.",
            "resume": "Resume this workflow? It runs again from its first step without a recorded output; the"
                      " steps recorded before are replayed, not run again.",
            "fork": "Fork this workflow? A new workflow with the same arguments replays the first N journal"
                    " entries copied from this one and runs the rest."}[action]
    fields = [tag("input", type="hidden", name="id", value=workflow_id),
              tag("input", type="hidden", name="action", value=action),
              tag("input", type="hidden", name="csrf", value=csrf)]
    if action == "fork":
        fields.append(tag("label", "entries copied (0 to ", str(steps), ") ",
                          tag("input", type="number", name="from_step", min="0", max=str(steps),
                              value=str(from_step if from_step is not None else steps), required=True)))
    body = tag("form", tag("p", what), tag("p", workflow_link(workflow_id)), *fields,
               tag("p", tag("button", f"Yes, {action}", type="submit", id="confirm", class_="button danger"),
                   " ", link(path("workflow", id=workflow_id), "No, go back")),
               method="post", action="/action", class_="confirm")
    return page(f"{action.capitalize()} {workflow_id}?", body, nav="workflows")


def login_page(message: str | None, csrf: str) -> Html:
    body = tag("form", tag("p", message, class_="error") if message else "",
               tag("input", type="text", name="username", value="pgflow", autocomplete="username", hidden=True),
               tag("label", "token ", tag("input", type="password", name="token", autocomplete="current-password",
                                          required=True, autofocus=True)),
               tag("input", type="hidden", name="csrf", value=csrf),
               tag("button", "Sign in", type="submit"), method="post", action="/login", class_="login")
    return page("Sign in", join([tag("p", "This dashboard asks for its token (PGFLOW_DASHBOARD_TOKEN or"
                                          " --token-file where it was started).", class_="note"), body]), nav=None)


def logout_page(csrf: str) -> Html:
    body = tag("form", tag("input", type="hidden", name="csrf", value=csrf),
               tag("button", "Sign out", type="submit", class_="button"), method="post", action="/logout",
               class_="login")
    return page("Sign out", join([tag("p", "Signing out ends this browser's session on the server: its cookie no"
                                          " longer signs anyone in.", class_="note"), body]), nav=None)


def message_page(title: str, text: str, back: str | None = None) -> Html:
    return page(title, join([tag("p", text, class_="error"), tag("p", link(back, "back")) if back else ""]))


def parse_time(text: str, now: datetime) -> datetime:
    """'1h', '30m', '7d' (ago) or an ISO time with its zone; ValueError saying what is expected."""
    from datetime import timedelta

    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    text = text.strip()
    if len(text) <= 12 and text[:-1].isascii() and text[:-1].isdigit() and text[-1:] in units:
        try:
            return now - timedelta(seconds=int(text[:-1]) * units[text[-1]])
        except OverflowError:  # further back than datetime (or timedelta) goes: year 1
            raise ValueError(f"{text!r} goes back before the year 1: use a shorter span") from None
    try:
        value = datetime.fromisoformat(text.replace("Z", "+00:00")) if len(text) <= 40 else None
    except ValueError:
        value = None
    if value is None or value.tzinfo is None or not (1 <= value.year <= 9999):
        raise ValueError(f"not a time: {text[:60]!r} (use 1h, 30m, 7d, or an ISO time with its zone such as"
                         " 2026-12-01T10:00Z)")
    return value
