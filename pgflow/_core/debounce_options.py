"""The options of a debounced start, checked before anything is written.

Apart from ``checks.py``, which checks what every start and setting is given: these rules are about how
debounce's options go together (a window and a key, or neither; no chosen id, delay or eta; an expiry
after the window), and ``workflow.py``'s ``with_options`` is their only caller.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from .checks import MAX_DELAY, MAX_ID_BYTES, check_positive_seconds, check_text

MAX_DEBOUNCE_KEY_BYTES = MAX_ID_BYTES  # a document's id, a user's: as long as a workflow id may be
DEBOUNCE_MAX_FACTOR = 10  # debounce_max's default, in windows


def check_debounce_window(window: object) -> float:
    """``debounce=``: the quiet seconds a debounced run waits for; zero would debounce nothing."""
    return check_positive_seconds(window, "debounce")


def check_debounce_key(key: object) -> str:
    return check_text(key, "debounce_key", MAX_DEBOUNCE_KEY_BYTES)


def check_debounce_max(most: object) -> float:
    """``debounce_max=``: the seconds from a burst's first start after which its run is due, however
    busy the key stays."""
    return check_positive_seconds(most, "debounce_max")


def check_debounce_combination(*, window: float | None, most: float | None, id: str | None, delay: float,
                               eta: datetime | None) -> None:
    """The debounce options that cannot go together, whatever is added to them later."""
    if window is None:
        return
    if id is not None:
        raise ValueError("debounce cannot be given with id=: the starts of a key collapse into one run whose "
                         "id pgflow chooses (every caller's handle reaches it); the debounce_key is what "
                         "names the run")
    if delay or eta is not None:
        raise ValueError("debounce cannot be given with delay= or eta=: a debounced run is due once its key "
                         "has been quiet for the window (debounce_max at the latest)")
    if most is not None and most < window:
        raise ValueError(f"debounce_max ({most:g}s) is below the debounce window ({window:g}s): a run is "
                         "due no later than debounce_max after its burst began, so it must be at least the window")


def check_debounce_complete(*, window: float | None, key: str | None, most: float | None) -> float | None:
    """A start's debounce options taken together: both of debounce and debounce_key, or neither (and
    no debounce_max without them). Returns debounce_max, its default filled in (10 windows)."""
    if window is None and key is None and most is None:
        return None
    if window is None:
        given = "debounce_key" if key is not None else "debounce_max"
        raise ValueError(f"{given} was given without debounce=: give the window too, e.g. "
                         "with_options(debounce=2.0, debounce_key='doc-42')")
    if key is None:
        raise ValueError("debounce= was given without debounce_key=: the key says which starts collapse "
                         "together, e.g. with_options(debounce=2.0, debounce_key='doc-42')")
    return most if most is not None else max(window, min(window * DEBOUNCE_MAX_FACTOR, MAX_DELAY))


def check_debounce_expiry(window: float, expires: datetime | float | None) -> None:
    """An expiry that a debounced run would reach before its first window ends could never run."""
    if expires is None:
        return
    due = datetime.now(UTC) + timedelta(seconds=window)
    if expires <= window if isinstance(expires, float) else expires <= due:
        raise ValueError(f"expires ({expires!r}) comes before the debounce window ({window:g}s) ends: the run "
                         "would be cancelled before it could begin")
