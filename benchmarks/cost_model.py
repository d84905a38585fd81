"""An alpha-beta cost model of pycyxwiz's all_reduce algorithms on H hosts of L ranks each: what each
algorithm costs, which is fastest, and which one pycyxwiz picks.

    python -m benchmarks.cost_model --table                 # the choice at 8 .. 1024 ranks, 10 and 100 Gbit/s
    python -m benchmarks.cost_model --validate --link 1gbit # measure the links, predict, compare with runs

Model (Hockney): a message of m bytes over a link costs alpha + m * beta. Links: shared memory inside a
host (alpha_s, beta_s), the host's NIC between hosts (alpha_n, beta_n). The ranks of a host are next to
each other in rank order (as launchers number them). A step in which the L ranks of a host all send m
bytes to other hosts puts L * m through the host's NIC, which is the bottleneck: the step costs
alpha_n + L * m * beta_n. Steps inside a host cost alpha_s + m * beta_s. Per algorithm (p = H * L, n the
message in bytes, pof2 = the largest power of two <= p):

  ring                 2(p-1) steps of n/p; one ring edge leaves each host: 2(p-1) (alpha_n + n/p beta_n)
                       (as soon as H > 1; inside one host the same with alpha_s, beta_s)
  recursive doubling   log2(pof2) exchanges of n (+2 steps to fold a world that is not a power of two); the
                       exchange at distance d crosses hosts when d >= L: alpha_n + L n beta_n, else shared memory
  halving-doubling     p a power of two: 2 log2(p) exchanges, the k-th of n/2^k, farthest partner first (as
                       allreduce_hd.cpp pairs them): the first log2(H) exchanges cross hosts
  hierarchical         2(L-1) shared-memory ring steps of n/L, and in between the all_reduce of n/L among
                       the H ranks of a column, all L columns at once through the NIC (the chosen inner
                       algorithm's cost with L x its bytes per NIC)
  hier-pipe            the pipelined hierarchical all_reduce (Note [Pipelined hierarchical all_reduce] in
                       hierarchical.cpp): K slices of s = n/K; per slice the ring halves inside the host
                       ((L-1) shared-memory steps of s/L each) and a direct reduce-scatter + all-gather across
                       hosts (2 steps; the NIC carries (H-1)/H s per step); the phases of different slices
                       overlap, so the time is the slowest phase K times plus the fill (one slice's
                       reduce-scatter) and the drain (one slice's all-gather); K as pycyxwiz picks it
  tree (reference)     a pipelined binary tree (reduce then broadcast), as NCCL's: 2 log2(p) alpha_n +
                       2 n beta_n (the pipeline's fill ignored); not implemented in pycyxwiz

CPU costs (reduction arithmetic, the copies of TCP) are left out: the model holds where the links, not
the CPUs, are the bottleneck (shaped links between hosts); --validate measures it there.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from dataclasses import dataclass

if __package__ in (None, ""):
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._report import format_table, human_size, write_json


@dataclass(frozen=True)
class Link:
    alpha: float  # seconds per message
    beta: float   # seconds per byte

    def cost(self, nbytes: float) -> float:
        return self.alpha + nbytes * self.beta


# Shared memory between two ranks on one host: a server's (alpha 1 us, 10 GB/s per pair) for the scale
# table; --validate measures ours.
SHM = Link(alpha=1e-6, beta=1 / 10e9)


def nic(gbit: float, alpha: float = 20e-6) -> Link:
    """A host's NIC of `gbit` Gbit/s; alpha: one message's latency over TCP between hosts (20 us: a
    datacenter TCP round trip's half, the kernel stacks included; measured links override it)."""
    return Link(alpha=alpha, beta=8 / (gbit * 1e9))


def _log2(x: int) -> int:
    return int(math.log2(x))


def _pof2(p: int) -> int:
    return 1 << _log2(p)


def ring(H: int, L: int, n: float, net: Link, shm: Link = SHM) -> float:
    p = H * L
    if p == 1:
        return 0.0
    # every step moves n/p over every edge at once: the slower of the NIC edge and the shared-memory ones
    step = max(net.cost(n / p) if H > 1 else 0.0, shm.cost(n / p) if L > 1 else 0.0)
    return 2 * (p - 1) * step


def _exchange(d: int, L: int, m: float, net: Link, shm: Link, H: int) -> float:
    """One step where every rank exchanges m bytes with the rank at distance d."""
    if H > 1 and d >= L:
        return net.alpha + L * m * net.beta
    return shm.cost(m)


def recursive_doubling(H: int, L: int, n: float, net: Link, shm: Link = SHM) -> float:
    p = H * L
    if p == 1:
        return 0.0
    pof2 = _pof2(p)
    t = sum(_exchange(1 << k, L, n, net, shm, H) for k in range(_log2(pof2)))
    if pof2 != p:  # fold in and out: neighbours (distance 1)
        t += 2 * _exchange(1, L, n, net, shm, H)
    return t


def halving_doubling(H: int, L: int, n: float, net: Link, shm: Link = SHM, nearest_first: bool = False
                     ) -> float | None:
    p = H * L
    if p & (p - 1) or p < 2:
        return None
    k = _log2(p)
    # farthest first (allreduce_hd.cpp): distance p/2 moves n/2, p/4 moves n/4, ...; the all-gather
    # mirrors it. Nearest first: distance 1 moves n/2, 2 moves n/4, ...: only the small late halves cross hosts.
    dist = (lambda j: 1 << j) if nearest_first else (lambda j: p >> (j + 1))
    return 2 * sum(_exchange(dist(j), L, n / 2 ** (j + 1), net, shm, H) for j in range(k))


def halving_doubling_nearest(H: int, L: int, n: float, net: Link, shm: Link = SHM) -> float | None:
    return halving_doubling(H, L, n, net, shm, nearest_first=True)


def tree(H: int, L: int, n: float, net: Link, shm: Link = SHM) -> float:
    p = H * L
    if p == 1:
        return 0.0
    alpha = net.alpha if H > 1 else shm.alpha
    beta = max(net.beta if H > 1 else 0.0, shm.beta if L > 1 else 0.0)
    return 2 * math.ceil(math.log2(p)) * alpha + 2 * n * beta


@dataclass(frozen=True)
class Thresholds:
    """pycyxwiz's automatic choices (csrc/distributed/backend/cpu_backend.cpp, algorithms/allreduce.cpp)."""
    small_2: int = 128 << 10    # recursive doubling at or below, 2 ranks
    small: int = 512 << 10      # the same, more ranks
    hd_max: int = 2 << 20       # halving-doubling at or below (p a power of two >= 4)
    hierarchical_from: int = 32 << 10  # auto: hierarchical from here, across hosts of several ranks
    by_link_from: int = 4 << 10  # above: by the measured link's cost, among 3+ ranks a host each

    def flat(self, p: int, n: float, group: int | None = None, link: Link | None = None, share: int = 1) -> str:
        """all_reduce's choice for n bytes among `group` ranks (default p) of a world of p (the small
        threshold is set by the world's size, the power-of-two test by the group's). `link`: the group's
        ranks are each on a host of their own and the link was measured at init, `share` of such groups
        using every host's link at once (Note [Choosing by the link] in algorithms/allreduce.cpp)."""
        g = group or p
        hd = g >= 4 and not g & (g - 1) and n <= self.hd_max
        if link is not None and g >= 3 and n > self.by_link_from:
            return by_link(g, n, link, share, hd, n <= (self.small_2 if p <= 2 else self.small))
        small = self.small_2 if p <= 2 else self.small
        if n <= small:
            return "recursive_doubling"
        return "halving_doubling" if hd else "ring"


def by_link(p: int, n: float, link: Link, share: int, hd: bool, rd_ok: bool = True) -> str:
    """allreduce.cpp's by_link: the cheapest of recursive doubling (up to the loopback threshold), halving-doubling
    (where allowed) and the ring by the alpha-beta cost on `link`, its time per byte times `share`."""
    a, b = link.alpha, link.beta * max(1, share)
    lg = _log2(p)
    rd = (lg + (2 if (1 << lg) != p else 0)) * (a + n * b)
    ring_t = 2.0 * (p - 1) * (a + n / p * b)
    hdc = 2.0 * lg * a + 2.0 * n * b * (p - 1) / p
    if hd and hdc <= ring_t and (not rd_ok or hdc < rd):
        return "halving_doubling"
    return "recursive_doubling" if rd_ok and rd <= ring_t else "ring"


FLAT = {"ring": ring, "recursive_doubling": recursive_doubling, "halving_doubling": halving_doubling,
        "halving_doubling_nearest": halving_doubling_nearest}


def hierarchical(H: int, L: int, n: float, net: Link, shm: Link = SHM, inner: str | None = None,
                 th: Thresholds = Thresholds()) -> float:
    """Intra-host ring halves around an all_reduce of n/L by the H ranks of each column."""
    intra = 2 * (L - 1) * shm.cost(n / L) if L > 1 else 0.0
    inner = inner or th.flat(H * L, n / L, H)
    # The L columns at once through one NIC: as one group of H ranks, one per host, with L x the bytes.
    wide = Link(net.alpha, net.beta * L)
    t = FLAT[inner](H, 1, n / L, wide, shm)
    return intra + (t if t is not None else ring(H, 1, n / L, wide, shm))


# hierarchical.cpp: slice = sqrt(n * SLICE_SCALE * L/(L-1)), pipelined up to PIPELINED_MAX_HOSTS hosts
SLICE_SCALE = 128 << 10
PIPELINED_MAX_HOSTS = 8


def slices(H: int, L: int, n: float) -> int:
    """The number of slices pycyxwiz cuts n bytes into (slice_count in hierarchical.cpp)."""
    if L == 1:
        return 1
    return max(1, math.ceil(n / math.sqrt(n * SLICE_SCALE * L / (L - 1))))


def hierarchical_pipelined(H: int, L: int, n: float, net: Link, shm: Link = SHM, k: int | None = None) -> float:
    """The minimum of n / s * (alpha_n + ...) + 2 (L-1) s/L beta_s over s is at s = sqrt(n alpha_n/beta_s
    L/(L-1)): what slices() computes with this VM's alpha_n/beta_s (~120 KB)."""
    k = k or slices(H, L, n)
    s = n / k
    half = (L - 1) * shm.cost(s / L) if L > 1 else 0.0           # one slice's reduce-scatter (or all-gather)
    across = 2 * (net.alpha + (H - 1) / H * s * net.beta)         # its trip across hosts, all L columns at once
    return 2 * half + k * max(across, 2 * half)


def pipelines(H: int, L: int, n: float, th: Thresholds = Thresholds()) -> bool:
    """hierarchical.cpp's `pipelined` (no slice forced)."""
    return H <= PIPELINED_MAX_HOSTS and n / L > (th.small_2 if H * L <= 2 else th.small)


def picked(H: int, L: int, n: float, th: Thresholds = Thresholds(), net: Link | None = None) -> str:
    """What pycyxwiz runs: CX_ALGORITHM=auto (Note [When to go hierarchical] in cpu_backend.cpp); `net`: the
    link between hosts as measured at init (it is, from 3 hosts up: Note [Choosing by the link])."""
    p = H * L
    link = net if H >= 3 else None
    if H > 1 and L > 1 and n >= th.hierarchical_from:
        return "hier-pipe" if pipelines(H, L, n, th) else "hierarchical/" + th.flat(p, n / L, H, link, L)
    return th.flat(p, n, None, link if L == 1 else None)


def cost(name: str, H: int, L: int, n: float, net: Link, shm: Link = SHM) -> float | None:
    if name.startswith("hierarchical"):
        inner = name.split("/", 1)[1] if "/" in name else None
        return hierarchical(H, L, n, net, shm, inner)
    if name == "tree":
        return tree(H, L, n, net, shm)
    if name == "hier-pipe":
        return hierarchical_pipelined(H, L, n, net, shm) if H <= PIPELINED_MAX_HOSTS else None
    return FLAT[name](H, L, n, net, shm)


CANDIDATES = ("ring", "recursive_doubling", "halving_doubling", "hierarchical/ring",
              "hierarchical/recursive_doubling", "hierarchical/halving_doubling", "hier-pipe", "halving_doubling_nearest",
              "tree")
NOT_IMPLEMENTED = ("tree", "halving_doubling_nearest")


def best(H: int, L: int, n: float, net: Link, shm: Link = SHM, implemented_only: bool = True) -> tuple[str, float]:
    names = [c for c in CANDIDATES if not (implemented_only and c in NOT_IMPLEMENTED)]
    if L == 1 or H == 1:
        names = [c for c in names if not c.startswith("hier")]
    costs = [(c, cost(c, H, L, n, net, shm)) for c in names]
    return min(((c, t) for c, t in costs if t is not None), key=lambda ct: ct[1])


SHORT = {"ring": "ring", "recursive_doubling": "RD", "halving_doubling": "HD", "tree": "tree",
         "halving_doubling_nearest": "HD-near", "hier-pipe": "hier-pipe"}


def short(name: str) -> str:
    if name.startswith("hierarchical/"):
        return "hier+" + SHORT[name.split("/", 1)[1]]
    return SHORT[name]


def scale_table(per_host: int = 8, gbits=(10, 100), ranks=(8, 64, 1024),
                sizes=(8, 64 << 10, 1 << 20, 16 << 20, 256 << 20), alpha: float = 20e-6) -> tuple[list, list]:
    headers = ["Gbit/s", "ranks", "size", "pycyxwiz picks", "its time", "best (implemented)", "best time",
               "picked/best", "best of all (incl. not implemented)"]
    rows = []
    for g in gbits:
        net = nic(g, alpha)
        for p in ranks:
            H, L = max(1, p // per_host), min(per_host, p)
            for n in sizes:
                pick = picked(H, L, n, net=net)
                tp = cost(pick, H, L, n, net)
                b, tb = best(H, L, n, net)
                ba, ta = best(H, L, n, net, implemented_only=False)
                rows.append([str(g), str(p), human_size(n), short(pick), f"{tp * 1e3:.3f} ms", short(b),
                             f"{tb * 1e3:.3f} ms", f"{tp / tb:.2f}x", f"{short(ba)} {ta * 1e3:.3f} ms"])
    return headers, rows


# ---- validation against measured runs (netns hosts, shaped links) -----------------------------------------

def _median_time(run, nominal: int) -> float | None:
    ranks = run.ranks if run.ranks and all(r is not None for r in run.ranks) else []
    for i in range(min((len(r["steps"]) for r in ranks), default=0)):
        per = [r["steps"][i] for r in ranks]
        if per[0]["nominal"] == nominal:
            return statistics.median(max(ts) for ts in zip(*(s["times"] for s in per)))
    return None


def measure_link(link: str | None, log=print) -> Link:
    """alpha and beta of one shaped link between two hosts (`link`), or of shared memory between two ranks
    of this host (None), from pycyxwiz's own pingpong of 8 B and 16 MiB: a round trip is two messages."""
    from benchmarks._launch import run_ranks

    big_n = 16 << 20
    run = run_ranks("pycyxwiz" if link else "pycyxwiz-shm", "benchmarks._collective_worker",
                    ["--op", "pingpong", "--sizes", "8", str(big_n), "--iters-scale", "0.5"], 2, 240, link=link)
    small, big = _median_time(run, 8), _median_time(run, big_n)
    if small is None or big is None:
        raise RuntimeError(f"pingpong over {link or 'shared memory'} failed: {run.reason}")
    alpha = small / 2
    beta = (big / 2 - alpha) / big_n
    log(f"  {link or 'shared memory'}: alpha {alpha * 1e6:.0f} us, 1/beta {1 / beta / 1e9:.3f} GB/s")
    return Link(alpha, beta)


def validate(link: str, points, sizes, log=print) -> dict:
    """Every (hosts, ranks per host, algorithm column) in `points` at every size: measured against predicted."""
    from benchmarks._launch import run_ranks

    net, shm = measure_link(link, log), measure_link(None, log)
    rows, out = [], []
    for H, L, col in points:
        lib = {"flat": "pycyxwiz-flat", "hier": "pycyxwiz-hier"}[col]
        run = run_ranks(lib, "benchmarks._collective_worker",
                        ["--op", "all_reduce", "--iters-scale", "0.3", "--sizes", *map(str, sizes)], H * L, 600,
                        link=link, per_host=L)
        for n in sizes:
            t = _median_time(run, n)
            th = Thresholds()
            measured = net if H >= 3 else None  # what rank 0 measures at init (Note [Choosing by the link])
            name = ((("hier-pipe" if pipelines(H, L, n, th) else
                      "hierarchical/" + th.flat(H * L, n / L, H, measured, L)))
                    if col == "hier" else th.flat(H * L, n, None, measured if L == 1 else None))
            pred = cost(name, H, L, n, net, shm)
            err = (pred / t - 1) if t else None
            out.append({"hosts": H, "per_host": L, "column": col, "algorithm": name, "bytes": n,
                        "measured_s": t, "predicted_s": pred, "error": err, "reason": run.reason})
            rows.append([f"{H}x{L}", col, short(name), human_size(n),
                         f"{t * 1e3:.1f} ms" if t else f"n/a ({run.reason})", f"{pred * 1e3:.1f} ms",
                         f"{100 * err:+.0f}%" if err is not None else ""])
            log(f"  {H}x{L} {col} {human_size(n)}: " + " ".join(rows[-1][4:]))
    return {"link": link, "alpha_s": net.alpha, "beta_s_per_byte": net.beta, "shm_alpha_s": shm.alpha,
            "shm_beta_s_per_byte": shm.beta, "points": out,
            "table": format_table(["hosts x ranks", "column", "algorithm", "size", "measured", "predicted",
                                   "error"], rows, markdown=True)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--table", action="store_true", help="the choice at scale (markdown)")
    ap.add_argument("--validate", action="store_true", help="measure links and runs, compare with the model")
    ap.add_argument("--link", default="1gbit")
    ap.add_argument("--alpha-us", type=float, default=20.0, help="the NIC's alpha in the scale table")
    ap.add_argument("--sizes", nargs="+", type=int, default=[1 << 20, 16 << 20, 64 << 20])
    a = ap.parse_args(argv)
    payload: dict = {"benchmark": "cost_model"}
    if a.validate:
        points = [(2, 1, "flat"), (3, 1, "flat"), (4, 1, "flat"), (2, 2, "flat"), (2, 2, "hier")]
        payload["validation"] = validate(a.link, points, a.sizes)
        print(payload["validation"]["table"])
    if a.table or not a.validate:
        headers, rows = scale_table(alpha=a.alpha_us * 1e-6)
        payload["scale"] = {"headers": headers, "rows": rows, "per_host": 8, "alpha_us": a.alpha_us}
        print(format_table(headers, rows, markdown=True))
    print(f"\nwrote {write_json('cost_model', payload)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
