"""A lost peer or a timed-out collective, explained by node rank and host instead of a 100-line traceback."""
from __future__ import annotations

import re
import sys
import time
from typing import Optional

from sft.distributed import watchdog
from sft.errors import PEER_LOST_EXIT_CODE, SFTError

# gloo names the peer as "[ip]:port" ("Connection closed by peer [10.0.0.3]:4123", "Read error [10.0.0.3]:4123:
# Connection reset by peer"); the first bracketed address is the peer (source paths in brackets start with "/").
_PEER_ADDR = re.compile(r"\[(\d{1,3}(?:\.\d{1,3}){3}|[0-9a-fA-F:]*:[0-9a-fA-F:]+)\]:(\d+)")


def explain_collective_failure(err: BaseException, timeout_s: Optional[float] = None,
                               peers: Optional[dict[str, dict]] = None) -> Optional[str]:
    """A user message for a torch.distributed failure during training, or None when ``err`` is not one.

    Recognises torch's gloo/NCCL messages that a peer closed its connection (the address is mapped to the
    node rank and host through ``peers``, the value returned by
    :func:`sft.distributed.fingerprints.check_same_inputs`) or that a collective timed out.
    ``timeout_s``: the ``--ddp_timeout`` in force, named in the message of a timeout.
    """
    torch = sys.modules.get("torch")  # not imported: then it cannot be a torch.distributed failure
    if torch is None:
        return None
    text = str(err)
    first = text.strip().splitlines()[0][:300] if text.strip() else type(err).__name__
    lowered = text.lower()
    dist_types = tuple(t for t in (getattr(getattr(torch, "distributed", None), "DistError", None),) if t)
    if not (isinstance(err, dist_types) or "gloo" in lowered or "nccl" in lowered or "connection closed" in lowered):
        return None
    m = _PEER_ADDR.search(text)
    who = ""
    if m:
        peer = (peers or {}).get(m.group(1))
        who = (f"the peer at {m.group(1)} is node rank {peer['node_rank']} ({peer['host']}, global rank(s) "
               f"{', '.join(map(str, peer['ranks']))}); " if peer else f"the peer was {m.group(1)}; ")
    if "timed out" in lowered or "timeout" in lowered:
        cause = (f"a collective got no answer within --ddp_timeout {timeout_s:g} s" if timeout_s
                 else "a collective timed out")
    else:
        cause = "another process of the job went away"
    seen = ""
    watcher = watchdog.current()
    if watcher is not None:  # where each rank was last seen (sft.distributed.watchdog): the one behind is the lead
        seen = f"\nLast progress seen: {last_seen(watcher.seen, time.time())}."
    return (f"training stopped: {cause}; {who}torch reports: {first}\nLook at the other nodes' logs for the first "
            "error (a crash, out of memory, a killed or preempted node); --ddp_timeout sets how long a lost node "
            "is waited for" + seen)




def last_seen(seen: dict, now_wall: float) -> str:
    """Where every rank was last seen, grouped: ``"rank(s) 1 in saving a checkpoint of step 40 (since 612 s); rank(s)
    0, 2-3 in ... (since 3 s)"``; empty before any beat."""
    groups: dict = {}
    for r, s in sorted(seen.items()):
        if s.beat is not None:
            groups.setdefault(watchdog.where(s.beat), []).append((r, s.beat["since"]))
    return "; ".join(f"rank(s) {watchdog.rank_ranges([r for r, _ in rs])} in {w} "
                     f"(since {max(0.0, now_wall - min(t for _, t in rs)):.0f} s)"
                     for w, rs in groups.items())


def hang_report_pending(watcher) -> bool:
    """True when ``watcher`` (this process's :class:`sft.distributed.watchdog.Watcher`, or None) has found a hang, or
    finds one within two beats while some rank has already stood still for half of ``--hang_timeout``: its report
    then ends the process, and a collective that failed meanwhile is a consequence, not the cause."""
    if watcher is None or watcher.timeout_s <= 0:
        return False
    if watcher.verdict is not None:
        return True
    now = time.monotonic()
    if not any(now - s.progress_at >= watcher.timeout_s / 2 for s in watcher.seen.values()):
        return False
    end = now + 2 * watcher.interval_s + 1
    while time.monotonic() < end and watcher.verdict is None:
        time.sleep(0.1)
    return watcher.verdict is not None


class PeerLost(SFTError):
    """Another process of the job went away, or a collective got no answer within ``--ddp_timeout``."""

    exit_code = PEER_LOST_EXIT_CODE


def raise_if_peer_lost(err: BaseException, timeout_s: Optional[float], peers: Optional[dict[str, dict]]) -> None:
    """Raise :class:`PeerLost` (from ``err``) when ``err`` is a lost peer or a timed-out collective; else return.
    An :class:`SFTError` is already a message for the user and is left as it is."""
    if isinstance(err, SFTError):
        return
    if hang_report_pending(watchdog.current()):
        # this process's watcher found a hang and is ending the process with its report (the SIGKILL of the frozen
        # rank is what made this collective fail): a second, different diagnosis would only mislead
        time.sleep(120)
    message = explain_collective_failure(err, timeout_s, peers)
    if message is not None:
        raise PeerLost(message) from err
