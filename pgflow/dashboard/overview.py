"""The overview page (``/``) and its live parts: the queues (with their pause buttons when actions
are on), the workers and the fleet's health. Apart from ``pages`` because it is one page of its own
made of several sections, read together every few seconds for all open overviews, and because it
is the one page that shows the fleet rather than a workflow; ``pages`` keeps the workflow pages."""

from __future__ import annotations

from typing import Any

from ..records import Health
from .data import COUNT_CAP, HEALTH_EVERY, LIVE_AFTER, OVERVIEW_EVERY, Overview
from .markup import Html, count, join, link, page, path, seconds, table, tag


def overview_page(view: Overview, csrf: str | None = None) -> Html:
    """``csrf``: this browser's token when actions are on (each queue then has a pause or resume button)."""
    body = tag("div", overview_parts(view, csrf), id="overview", data_live="/live/overview")
    return page("Overview", body, nav="overview",
                refresh_note=f"Live: the queues and workers are read every {OVERVIEW_EVERY:g} s, health every"
                             f" {HEALTH_EVERY:g} s, for all open pages together. Without JavaScript, reload.")


def overview_parts(view: Overview, csrf: str | None = None) -> Html:
    return join([_queues(view, csrf), _workers(view), _health(view.health, view.health_error, view.listener),
                 tag("p", f"About {max(0, view.estimated_workflows):,.0f} workflows in the table (the planner's"
                          " estimate).", class_="note") if view.estimated_workflows >= 0 else ""])


def _queues(view: Overview, csrf: str | None) -> Html:
    t = view.throughput
    span = "the last hour" if not t.estimated else f"the last hour (scaled from the last {seconds(t.window_s)})"
    rows: list[list[object]] = []
    for q in view.queues:
        limits = []
        if q.concurrency is not None:
            limits.append(f"{q.concurrency} at once")
        if q.rate_limit is not None:
            limits.append(f"{q.rate_limit} per {seconds(q.rate_period_s)}")
        rows.append([link(path("workflows", queue=q.name), q.name), count(q.queued, COUNT_CAP),
                     count(q.due, COUNT_CAP), seconds(q.oldest_due_waited_s), count(q.running, COUNT_CAP),
                     ", ".join(limits) or "-",
                     f"{'~' if t.estimated else ''}{q.finished_last_hour:,.0f}",
                     f"{'~' if t.estimated else ''}{q.failed_last_hour:,.0f}",
                     "-" if q.paused_since is None else tag(
                         "span", "paused since ", q.paused_since.isoformat(timespec="seconds"), class_="bad"),
                     *([_pause_button(q.name, q.paused_since is None, csrf)] if csrf is not None else [])])
    return tag("section", tag("h2", "Queues"),
               table(["queue", "queued", "due now", "oldest due waited", "running", "limits",
                      "finished, last hour", "failed, last hour", "paused", *(["action"] if csrf else [])],
                     rows, "no queue has work or limits", id="queues"),
               tag("p", f"Counts stop at {COUNT_CAP:,} (shown as {COUNT_CAP:,}+); throughput over {span}.",
                   class_="note"))


def _pause_button(queue: str, pause: bool, csrf: str) -> Html:
    """A form that pauses (or resumes) ``queue``: the fleet stops (or starts again) claiming its work."""
    action = "pause" if pause else "resume"
    return tag("form", tag("input", type="hidden", name="queue", value=queue),
               tag("input", type="hidden", name="action", value=action),
               tag("input", type="hidden", name="csrf", value=csrf),
               tag("button", action.capitalize(), type="submit", class_="button" + (" danger" if pause else ""),
                   id=f"{action}-{queue}"),
               method="post", action="/queue-action", class_="inline")


def _workers(view: Overview) -> Html:
    rows: list[list[object]] = []
    for w in view.workers:
        runs = join(tag("span", f"{name} ×{n}", class_="chip") for name, n in w.running_names) or "-"
        state = tag("span", "DEAD", class_="status status-failed") if w.dead else tag(
            "span", "live", class_="status status-succeeded")
        rows.append([state, tag("code", w.id), f"{w.host} pid {w.pid}", ", ".join(w.queues),
                     seconds(w.heartbeat_age_s), seconds(w.lease_s), seconds(w.up_s), w.running, runs, w.version])
    note = ("A worker is dead when its heartbeat is older than its lease (or, for a worker that did not record"
            f" its lease, {LIVE_AFTER:g} s), or a lease it holds has run out: other workers take its workflows"
            " over.")
    return tag("section", tag("h2", "Workers"),
               table(["state", "id", "where", "queues", "heartbeat", "lease", "up", "running", "what it runs",
                      "version"],
                     rows, "no worker is registered", id="workers"),
               tag("p", note, class_="note"))


def _health(health: Health | None, error: str | None, listener: dict[str, Any]) -> Html:
    if health is None:
        return tag("section", tag("h2", "Health"), tag("p", f"could not be read: {error}", class_="error"))
    items: list[Html] = [
        tag("li", f"{health.live_workers} live workers" if health.live_workers else "no live worker",
            class_=None if health.live_workers else "bad"),
        tag("li", f"NOTIFY queue {health.notification_queue_usage:.1%} full",
            class_="bad" if health.notification_queue_usage > 0.5 else None),
    ]
    for name, n in health.unserved.items():
        items.append(tag("li", f"{n:,} queued workflows named ", tag("code", name), ": no live worker runs that name",
                         class_="bad"))
    items += _waiting_problems(health)
    items += [tag("li", "queue ", tag("code", queue), f" paused since {since.isoformat(timespec='seconds')}:"
                  " its workflows wait until it is resumed") for queue, since in health.paused.items()]
    for session in health.stuck_sessions:
        items.append(tag("li", f"session {session.pid} ({session.application_name or 'no application name'}) idle in"
                               f" a transaction for {seconds(session.transaction_age_s)}", class_="bad"))
    if health.queue_holders:
        items.append(tag("li", "oldest open transactions of the cluster (one that ran LISTEN holds the NOTIFY"
                               " queue back): ", join(tag("div", s.describe()) for s in health.queue_holders)))
    for holder in health.maintenance:
        items.append(tag("li", "maintenance leader: ", holder.describe(), class_=None if holder.worker else "bad"))
    if not health.maintenance:
        items.append(tag("li", "maintenance: no worker holds a service's lock"))
    items.append(tag("li", "this dashboard's listener: " + (
        "connected" if listener["connected"] else "not connected (it listens only while a page waits on a"
                                                  " stream)")
        + f", {listener['reconnects']} reconnects, {listener['pings_rejected']} payloads rejected"))
    verdict = tag("strong", "healthy" if health.ok else "UNHEALTHY", class_="ok" if health.ok else "bad")
    return tag("section", tag("h2", "Health: ", verdict), tag("ul", *items, id="health"),
               tag("p", "What pgflow status checks; it exits non-zero when this says UNHEALTHY.", class_="note"))


def _waiting_problems(health: Health) -> list[Html]:
    """The problems of work that waits (the lines ``pgflow status`` prints for them): a queue no live
    worker serves, a queue whose oldest due workflow waited too long, a dead worker while its queues
    have work."""
    items = [tag("li", f"{n:,} workflows waiting on queue ", tag("code", queue), ": no live worker serves that queue",
                 class_="bad") for queue, n in health.unserved_queues.items()]
    items += [tag("li", "the oldest due workflow on queue ", tag("code", queue), f" has waited {seconds(waited)}"
                  f" (more than the {seconds(health.max_wait_s)} allowed)", class_="bad")
              for queue, waited in health.overdue.items()]
    items += [tag("li", "worker ", tag("code", w.id), f" is dead (heartbeat {seconds(w.heartbeat_age_s)} old) while"
                  " work waits on its queues ", tag("code", ", ".join(w.queues)), class_="bad")
              for w in health.dead_workers]
    return items
