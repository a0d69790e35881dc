"""Why another system's figure beats chameleon-ft's, computed from the runs' own data.

No fixed sentences: every reason quotes the figures it rests on (global batch before / after
from the commit records, samples lost from the trained ids, startup from the first step's time,
the recovery's phase breakdown, the machine's core count), and a difference is called noise only
when it lies within the run-to-run spread measured on repeated cells of the same mode
(``Spread``).  Anything else is "not explained", with the measured difference.
"""

from __future__ import annotations

import math
import statistics
from typing import Optional

# Hang detection timeouts the harness configures (``systems.py`` --hang-timeout, the process
# group timeouts in ``baselines/torchft_ddp.py``); torchrun has none (gloo's 30 min default).
HANG_TIMEOUT_S = {"chameleon-ft": 5.0, "torchft+fix": 5.0, "torchft-tuned": 2.0, "torchft": 60.0}
# chameleon-ft's Lighthouse heartbeat timeout (``chameleon_ft/runtime/membership.py``) and the
# tuned TorchFT Lighthouse's (``systems.LIGHTHOUSE``).
HEARTBEAT_TIMEOUT_MS = {"chameleon-ft": 1000, "torchft-tuned": 300, "torchft+fix": 5000, "torchft": 5000}


def value(r, key):
    """A run's figure ``key`` (``mttr2_s``: the second recovery's MTTR)."""
    if key == "mttr2_s":
        m = r.get("mttrs_s") or []
        return m[1] if len(m) > 1 else None
    return r.get(key)


def median(rows, key):
    vals = [v for r in rows if (v := value(r, key)) is not None]
    return statistics.median(vals) if vals else None


class Spread:
    """Run-to-run spread per figure, measured on the repeated cells (same system, scenario,
    workers and mode, at least 2 runs that did not crash): (max - min) / |median|, the largest
    over the cells of a mode, with the cell it came from."""

    def __init__(self, res: dict, keys):
        cells: dict = {}
        for r in res["runs"]:
            if not r["crashed"]:
                cells.setdefault((r["mb_sleep"], r["nproc"], r["system"], r["scenario"]), []).append(r)
        self.rel: dict = {}
        for (mb, nproc, system, scenario), rows in cells.items():
            if len(rows) < 2:
                continue
            for key in keys:
                vals = [v for r in rows if (v := value(r, key)) is not None]
                if len(vals) < 2 or not statistics.median(vals):
                    continue
                rel = (max(vals) - min(vals)) / abs(statistics.median(vals))
                if rel > self.rel.get((mb, key), (-1.0, ""))[0]:
                    self.rel[(mb, key)] = (rel, f"{system} {scenario} x{len(vals)}, {nproc} workers")

    def noise(self, key, mb, mine, other) -> Optional[str]:
        """A sentence when |other - mine| is within the measured spread, else None."""
        got = self.rel.get((mb, key))
        if got is None or not mine:
            return None
        rel, cell = got
        diff = abs(other - mine) / abs(mine)
        if diff <= rel:
            return (f"a {diff:.1%} difference, within the run-to-run spread of this figure measured on "
                    f"repeated runs ({rel:.1%}: {cell}): noise")
        return None

    def describe(self, key, mb) -> str:
        got = self.rel.get((mb, key))
        return f"measured run-to-run spread {got[0]:.1%} ({got[1]})" if got else "no repeated cell in this mode"


def representative(rows, key) -> dict:
    """The run whose ``key`` is the median of ``rows`` (the lower middle one of an even count)."""
    have = sorted((r for r in rows if value(r, key) is not None), key=lambda r: value(r, key))
    return have[(len(have) - 1) // 2] if have else rows[0]


def hang_note(systems) -> str:
    """The hang detection timeouts the harness sets for the systems in the table."""
    known = [f"{s} {HANG_TIMEOUT_S[s]:g} s" for s in systems if s in HANG_TIMEOUT_S]
    return ("A hang is only visible through a timeout; this harness sets " + ", ".join(known)
            + " (chameleon-ft: `--hang-timeout`; TorchFT: its process-group timeout); torchrun and plain "
            "Lightning have none but gloo's 30-minute default.") if known else ""


def samples_per_step(r) -> Optional[float]:
    """Samples of the run's last committed step (the trained ids; the timeline's third column)."""
    tl = r.get("timeline") or []
    return tl[-1][2] if tl else None


def micro_batches(res) -> int:
    return res.get("global_batch", 64) // res.get("micro_batch", 8)


def cores(res) -> Optional[int]:
    if res.get("cpu_count"):
        return res["cpu_count"]
    head = res.get("machine", "").split(" CPU cores")[0].split()
    return int(head[-1]) if head and head[-1].isdigit() else None


def ff_row(res, r) -> Optional[dict]:
    """The same system's (or family's) failure-free run of the same mode and worker count."""
    for match in ("system", "family"):
        for x in res["runs"]:
            if (x["scenario"] == "failure-free" and x[match] == r[match] and x["nproc"] == r["nproc"]
                    and x["mb_sleep"] == r["mb_sleep"] and not x["crashed"]):
                return x
    return None


def efficiency_reason(res, r, spread: Spread) -> str:
    """Why ``r``'s post-recovery efficiency is what it is: the decomposition into samples a
    step, step time and world, then the cause the data supports, or "not explained"."""
    e, n, w = r.get("efficiency"), r["nproc"], r.get("survivors")
    ff = ff_row(res, r)
    if e is None or not w or ff is None or not ff.get("step_time_s") or not r.get("step_time_after_s"):
        return "not explained (no failure-free run to compare with)"
    st0, st1 = ff["step_time_s"], r["step_time_after_s"]
    spp1 = samples_per_step(r)
    base = res.get("global_batch", 64)
    parts = [f"{e:.2f} ≈ samples a step {spp1}/{base} x step time {st0 * 1e3:.0f}/{st1 * 1e3:.0f} ms "
             f"÷ world {w}/{n}"]
    if r.get("throughput_before") and r.get("failure_free_throughput"):
        own = r["throughput_after"] / (r["throughput_before"] * w / n)
        drift = r["throughput_before"] / r["failure_free_throughput"] - 1
        if abs(drift) > 0.05:
            parts.append(f"this run's own before-failure throughput was {drift:+.0%} against the failure-free "
                         f"run's, so against its own before the efficiency is {own:.2f}")
        e = min(e, own)
    if r.get("samples_lost"):
        parts.append(f"its survivors train only their own shards ({r['samples_lost']} samples lost, counted from "
                     "the trained ids)")
    c, m = cores(res), micro_batches(res)
    if r["mb_sleep"] == 0 and c:
        share = min(1.0, c / w) / min(1.0, c / n)
        parts.append(f"plain CPU: {n} processes shared {c} cores failure-free, {w} after, so each gets up to "
                     f"{share:.2f}x the CPU")
        bound = share
    else:
        # Micro-batches a survivor runs: its own shard when the dead shard is dropped (lost samples),
        # else the busiest one's share of the step's micro-batches (shrink: of the smaller batch).
        m1 = (r.get("batch_last") or base) // (base // m)
        per1 = m // n if r.get("samples_lost") else math.ceil(m1 / w)
        ratio = per1 / (m // n)
        bound = (spp1 or base) / base / (ratio * w / n)
        parts.append(f"emulation: the busiest survivor runs {per1} micro-batches a step (failure-free {m // n}), "
                     f"so the step should take {ratio:.2f}x as long: efficiency at most {bound:.2f} from "
                     "the emulated compute")
    rel = spread.rel.get((r["mb_sleep"], "efficiency"), (0.0, ""))[0]
    if e <= bound * (1 + rel) + 1e-9:
        parts.append("explained" + (f" within the measured spread ({rel:.0%})" if e > bound else ""))
    else:
        spread_text = spread.describe("efficiency", r["mb_sleep"])
        parts.append(f"the remaining {e / bound:.2f}x is not explained ({spread_text})")
    return "; ".join(parts)


def reason(res, key, other_rows, our_rows, scenario, spread: Spread) -> str:
    """Why ``other_rows``' median ``key`` beats chameleon-ft's (``our_rows``); the figures quoted
    come from each side's run that holds the median."""
    o, me = representative(other_rows, key), representative(our_rows, key)
    mb = o["mb_sleep"]
    mine, other = median(our_rows, key), median(other_rows, key)
    noise = spread.noise(key, mb, mine, other)
    mech = _mechanism(res, key, o, me, scenario, spread)
    if noise and (not mech or mech.startswith("not explained")):
        return noise
    if mech and noise:
        return f"{mech}; also {noise}"
    if mech or noise:
        return mech or noise
    return (f"not explained (a {abs(other - mine) / abs(mine):.1%} difference; "
            f"{spread.describe(key, mb)})" if mine else "not explained") + _granularity(res, our_rows, key)


def _granularity(res, rows, key) -> str:
    if key not in ("efficiency", "throughput_after", "step_time_after_s"):
        return ""
    w, m = median(rows, "survivors"), micro_batches(res)
    if not w or m % int(w) == 0:
        return ""
    w = int(w)
    return (f"; micro-batches are indivisible: {m} over chameleon-ft's {w} survivors leaves the busiest "
            f"{-(-m // w)} where {m / w:.2f} would be even (at most {m / w / -(-m // w):.0%} of ideal)")


def _mechanism(res, key, o, me, scenario, spread) -> Optional[str]:
    system, n = o["system"], o["nproc"]
    first, last = o.get("batch_first"), o.get("batch_last")
    if key == "efficiency":
        return efficiency_reason(res, o, spread)
    if first and last and last < first and key in ("throughput", "throughput_after", "step_time_after_s",
                                                   "wall_s", "final_loss"):
        st = o.get("step_time_after_s")
        return (f"{system} cut the global batch from {first} to {last} samples after the failure "
                f"({o.get('survivors')} survivors)" + (f": a step of {last} samples in {st * 1e3:.0f} ms against "
                                                       f"chameleon-ft's {samples_per_step(me)} in "
                                                       f"{me['step_time_after_s'] * 1e3:.0f} ms"
                                                       if st and me.get("step_time_after_s") else "")
                + ("; another trajectory" if key == "final_loss" else "") + _granularity(res, [me], key))
    if o.get("samples_lost") and not me.get("samples_lost") and key in (
            "throughput", "throughput_after", "step_time_after_s", "final_loss"):
        return (f"{system} never trained {o['samples_lost']} samples of its steps (counted from the trained ids; "
                f"its last step trained {samples_per_step(o)} of {res.get('global_batch', 64)}), chameleon-ft "
                "none" + _granularity(res, [me], key))
    if (key in ("throughput_after", "step_time_after_s") and o.get("survivors") == n
            and (me.get("survivors") or n) < n):
        return (f"{system} trains with all {n} workers again after its restart (world {o['survivors']} at the end, "
                f"chameleon-ft {me.get('survivors')}; it redid {o.get('samples_duplicated') or 0} samples)"
                + _granularity(res, [me], key))
    if key == "wall_s" and o.get("startup_s") is not None and me.get("startup_s") is not None:
        d_start = me["startup_s"] - o["startup_s"]
        d_wall = me["wall_s"] - o["wall_s"]
        text = (f"start to first step {o['startup_s']:.1f} s vs chameleon-ft's {me['startup_s']:.1f} s, "
                f"training {o['wall_s'] - o['startup_s']:.1f} s vs {me['wall_s'] - me['startup_s']:.1f} s")
        return text + ("" if d_wall > 0 and d_start >= d_wall / 2 else ": not explained")
    if key in ("mttr_s", "mttr2_s") and scenario == "hang":
        t_o, t_me = HANG_TIMEOUT_S.get(system), HANG_TIMEOUT_S.get("chameleon-ft")
        if t_o is not None and t_o < t_me:
            return (f"a hang is seen through a timeout: {system}'s is {t_o:g} s, chameleon-ft's {t_me:g} s "
                    f"(harness settings); MTTR past the timeout {o[key] - t_o:.2f} s vs {me[key] - t_me:.2f} s")
    if key == "mttr_s" and scenario == "node-loss":
        bd = ((me.get("chameleon") or {}).get("breakdowns") or [{}])[0]
        hb_o, hb_me = HEARTBEAT_TIMEOUT_MS.get(system), HEARTBEAT_TIMEOUT_MS["chameleon-ft"]
        if bd.get("membership") and hb_o and hb_o < hb_me:
            return (f"chameleon-ft's membership phase took {bd['membership'] * 1e3:.0f} ms of its "
                    f"{bd.get('total', 0) * 1e3:.0f} ms: with half the workers gone its split-brain guard waits for "
                    f"their heartbeats to expire ({hb_me} ms); {system}'s Lighthouse heartbeat timeout is {hb_o} ms")
    if key == "peak_rss_mb":
        return (f"not explained: {me['peak_rss_mb'] - o['peak_rss_mb']:+.0f} MB per worker, which this harness "
                "does not break down (chameleon-ft's worker also loads its runtime: membership client, engine)")
    fixed = system[len("chameleon-ft["):-1] if system.startswith("chameleon-ft[") else None
    chosen = {d["chosen"] for d in (me.get("chameleon") or {}).get("decisions", [])}
    if fixed and fixed in chosen | ({"reroute", "replan"} if chosen & {"reroute", "replan"} else set()):
        noise = spread.noise(key, o["mb_sleep"], median([me], key), o[key])
        return (f"the adaptive run chose {', '.join(sorted(chosen))}, the same recovery path (on a data-parallel "
                "plan reroute and replan give the same allocation)"
                + ("" if noise else f", yet the difference exceeds the {spread.describe(key, o['mb_sleep'])}: "
                   "not explained"))
    return None
