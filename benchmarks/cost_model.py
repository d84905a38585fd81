"""An alpha-beta cost model of pycyxwiz's all_reduce, all_gather, reduce_scatter, broadcast and reduce algorithms.
On H hosts of L ranks each: what each algorithm costs, which is fastest, and which one pycyxwiz picks.

    python -m benchmarks.cost_model --table                 # the choice at 8 .. 1024 ranks, 10 and 100 Gbit/s
    python -m benchmarks.cost_model --table --op all_gather # the same for all_gather, reduce_scatter, broadcast, reduce
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

all_gather and reduce_scatter (--op) are sized by the block b that each rank gives or keeps, the unit of the
C++ thresholds (the whole result or input is p b); broadcast by its message n, root 0. A step of the three
is costed from its messages: the busiest host's NIC (alpha_n + beta_n times the more of the bytes that leave
it and that arrive) against the largest message inside a host (alpha_s + m beta_s), the slower of the two.

  all_gather ring      p-1 steps of b: (p-1) max(alpha_n + b beta_n, alpha_s + b beta_s)
  Bruck                ceil(log2 p) steps, at distance d = 1, 2, 4, ... each rank sends min(d, p-d) blocks to
                       r-d (d of a host's ranks cross to the next host while d < L, all L from d >= L), plus a
                       copy of the whole result, p b beta_s; pycyxwiz: p >= 4, b <= 8 KiB through rings only /
                       128 KiB where sockets carry a pair, p b <= 64 MiB
  reduce_scatter ring  p-1 steps of b, as the all_gather's
  recursive halving    the blocks copied into one buffer (p b beta_s); where p is not a power of two the even
                       ranks below 2 rem (rem = p - pof2) send all p b to the next rank (a step of p b) and get
                       their block back at the end (a step of b); log2(pof2) halving steps among pof2 virtual
                       ranks, farthest partner first, each sending the blocks of the half of its range that the
                       partner keeps (p b/2, p b/4, ... where p is a power of two; virtual ranks standing for two
                       hold two blocks each); pycyxwiz: p >= 4 (5, 6, 7, ... folded: main's 837b1fd),
                       b <= 1 KiB through rings / 16 KiB with sockets
  hierarchical         up to 8 hosts direct: all_gather posts its block to its column's H-1 peers at once (the
  (both, --op)         NIC carries L(H-1) b each way, every block arriving at its end: alpha_n + L(H-1) b beta_n)
                       and gathers inside its host H times (g: the flat all_gather of L blocks, shared memory),
                       its own host's first: max(g, alpha_n + L(H-1) b beta_n) + (H-1) g; reduce_scatter sums
                       inside its host H times (g), the other hosts' first, posting each sum at once:
                       max(H g, g + alpha_n + L(H-1) b beta_n, (H-1) g + alpha_n + L b beta_n). Above 8 hosts one
                       after the other: the columns' flat all_gather (L x the bytes through the NIC) then H g, or
                       H g then the columns' flat reduce_scatter
  broadcast tree       binomial, farthest child first: ceil(log2 p) rounds of n; the rounds of distance >= L
                       cross hosts (one message per host's NIC)
  chain                pipelined in chunks c (512 KiB between hosts, 256 KiB on one host): the first chunk over
                       all p-1 hops, then one slowest hop per further chunk: (H-1)(alpha_n + c beta_n) +
                       (p-H)(alpha_s + c beta_s) + (n/c - 1) max(alpha_n + c beta_n, alpha_s + c beta_s)
  star                 one host, single copies, above 64 KiB: alpha_s + n beta_s (the p-1 readers at once, not
                       slowing each other down)
  hierarchical         the root's column (H ranks, one a host) then inside every host (L ranks), one after the
                       other, each by the flat rule (no star: every pair agreed it)
  scatter+AG, chain    (reference, not pycyxwiz's) van de Geijn's binomial scatter of n/p a rank and ring
  (best chunk)         all_gather; the chain with its cheapest chunk
  reduce               broadcast's tree and chain with every message the other way round (the same bytes through
                       each NIC, which the model counts the more of what leaves and what arrives); the tree's
                       rounds summed, where the C++ pipelines its chunks across them; the reduction's arithmetic
                       left out. Hierarchical: the tree inside every host, then the root's column

CPU costs (reduction arithmetic, the copies of TCP) are left out: the model holds where the links, not
the CPUs, are the bottleneck (shaped links between hosts); --validate measures it there. Bruck's and the
halving's copy of the whole is the one copy counted (it is what they add to the ring).
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from dataclasses import dataclass
from typing import Callable

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
    if not _is_pof2(p) or p < 2:
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


FLAT: dict[str, Callable[..., float | None]] = {
    "ring": ring, "recursive_doubling": recursive_doubling, "halving_doubling": halving_doubling,
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
              "hierarchical/recursive_doubling", "hierarchical/halving_doubling", "hier-pipe",
              "halving_doubling_nearest", "tree")
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
                assert tp is not None, (pick, H, L, n)
                b, tb = best(H, L, n, net)
                ba, ta = best(H, L, n, net, implemented_only=False)
                rows.append([str(g), str(p), human_size(n), short(pick), f"{tp * 1e3:.3f} ms", short(b),
                             f"{tb * 1e3:.3f} ms", f"{tp / tb:.2f}x", f"{short(ba)} {ta * 1e3:.3f} ms"])
    return headers, rows


# ---- all_gather, reduce_scatter, broadcast -------------------------------------------------------------------
# Sizes: all_gather and reduce_scatter by the block b each rank gives or keeps (the unit of the C++ thresholds; the
# whole result, or input, is p * b); broadcast by its message n, root 0.

# cpu_backend.cpp, algorithms.h, allgather.cpp, hierarchical.cpp (Note [Bruck's all_gather], Note [Reduce-scatter by
# recursive halving], Note [Broadcast from the root to all], Note [When to go hierarchical])
SMALL_ALL_GATHER = {"rings": 8 << 10, "sockets": 128 << 10}   # kSmallAllGatherBytes{Rings,Sockets}
SMALL_REDUCE_SCATTER = {"rings": 1 << 10, "sockets": 16 << 10}  # kSmallReduceScatterBytes{Rings,Sockets}
BRUCK_MOST_BYTES = 64 << 20     # kBruckMostBytes: Bruck's whole result (its scratch) at most this
SMALL_BROADCAST = 64 << 10      # AlgoOptions::small_broadcast_bytes: binomial tree at or below
STAR_SKIP_THREE_RANKS = (768 << 10, 4 << 20)  # kStarBroadcastSkip{From,To}ThreeRanks: the chain there
HIERARCHICAL_FROM = Thresholds.hierarchical_from  # kHierarchicalMinBytes: of the whole (p * b) for the two above


@dataclass(frozen=True)
class Agreed:
    """What the ranks agree on at init for the three collectives (CpuBackend::agree_on_single_copies and
    default_options in cpu_backend.cpp): the largest block of Bruck's all_gather and of the halving reduce_scatter
    in the world and inside a host, whether a broadcast goes from the root to all (and where not, on 3 ranks), and
    the chunk of the chain."""
    all_gather: int = SMALL_ALL_GATHER["rings"]  # the AlgoOptions defaults: what a world of 2 keeps
    reduce_scatter: int = SMALL_REDUCE_SCATTER["rings"]
    in_host_all_gather: int = SMALL_ALL_GATHER["rings"]
    in_host_reduce_scatter: int = SMALL_REDUCE_SCATTER["rings"]
    star: bool = False
    star_skip: tuple[int, int] = (0, 0)
    chunk: int = 512 << 10
    link: Link | None = None  # the link between hosts as rank 0 measured it at init (from 3 hosts up)


def agreed(H: int, L: int, shm_on: bool = True, single_copies: bool = True, oversubscribed: bool = False,
           net: Link | None = None) -> Agreed:
    """For H hosts of L ranks, shared memory inside a host (CX_SHM) on or off: every pair goes through shared-memory
    rings only on one host with it on (the Rings thresholds), else some pair through sockets (the Sockets ones);
    a host's own pairs through rings where it is on; the root to all only on one host with single copies. The
    chunk: 256 KiB on one host with shared memory, 1 MiB where a host has more ranks than cores, else 512 KiB.
    `net`: the link between hosts, which CpuBackend::measure_link measures from 3 hosts up."""
    p = H * L
    chunk = (256 << 10) if shm_on and H == 1 else (1 << 20) if oversubscribed else (512 << 10)
    link = net if H >= 3 else None
    if p < 3:  # agree_on_single_copies returns at once: the defaults stand
        return Agreed(chunk=chunk, link=link)
    world = "rings" if shm_on and H == 1 else "sockets"
    host = "rings" if shm_on and L > 1 else "sockets"
    star = shm_on and single_copies and H == 1
    return Agreed(SMALL_ALL_GATHER[world], SMALL_REDUCE_SCATTER[world], SMALL_ALL_GATHER[host],
                  SMALL_REDUCE_SCATTER[host], star, STAR_SKIP_THREE_RANKS if star and p == 3 else (0, 0), chunk, link)


def _step(msgs, L: int, net: Link, shm: Link) -> float:
    """One step whose messages (from rank, to rank, bytes) are all under way at once: the busiest host's NIC (the
    more of what leaves it and what arrives) against the largest message between two ranks of one host."""
    out: dict[int, float] = {}
    into: dict[int, float] = {}
    inside = -1.0
    for a, b, m in msgs:
        ha, hb = a // L, b // L
        if ha != hb:
            out[ha] = out.get(ha, 0.0) + m
            into[hb] = into.get(hb, 0.0) + m
        else:
            inside = max(inside, m)
    t = shm.cost(inside) if inside >= 0 else 0.0
    return max(t, net.cost(max(max(out.values()), max(into.values())))) if out else t


def _ring_step(H: int, L: int, m: float, net: Link, shm: Link) -> float:
    """A ring step of m bytes a rank: one ring edge leaves each host (_step over the ring, in closed form)."""
    return max(net.cost(m) if H > 1 else 0.0, shm.cost(m) if L > 1 else 0.0)


def _is_pof2(p: int) -> bool:
    return p > 0 and not p & (p - 1)


# all_gather ----------------------------------------------------------------------------------------------------

def all_gather_ring(H: int, L: int, b: float, net: Link, shm: Link = SHM) -> float:
    return (H * L - 1) * _ring_step(H, L, b, net, shm)


def all_gather_bruck(H: int, L: int, b: float, net: Link, shm: Link = SHM) -> float:
    """Steps d = 1, 2, 4, ... < p: every rank sends min(d, p-d) blocks to rank r-d; then the blocks go from its
    scratch to their places, a copy of the whole (p b at shared memory's time per byte)."""
    p, d = H * L, 1
    t = p * b * shm.beta
    while d < p:
        m = min(d, p - d) * b
        t += _step(((r, (r - d) % p, m) for r in range(p)), L, net, shm)
        d *= 2
    return t


def all_gather_recursive_doubling(H: int, L: int, b: float, net: Link, shm: Link = SHM) -> float | None:
    """Not in pycyxwiz: p a power of two, log2 p exchanges with r ^ d of d blocks, nearest first."""
    p = H * L
    if not _is_pof2(p):
        return None
    return sum(_step(((r, r ^ d, d * b) for r in range(p)), L, net, shm) for d in (1 << k for k in range(_log2(p))))


# Note [Bruck's all_gather between hosts] in allgather.cpp: among ranks a host each with the link measured, Bruck's
# blocks also at most this many of the link's alpha in bytes
BRUCK_MOST_ALPHAS = 16


def pick_all_gather_flat(p: int, b: float, most: int, link: Link | None = None, share: int = 1) -> str:
    """all_gather in allgather.cpp (bruck_pays): Bruck's on 4 ranks or more, blocks up to `most`, the whole at most
    64 MiB, and where the ranks are each on a host of their own with the link measured (`link`, `share` transports
    using it at once), a block's time on the link at most BRUCK_MOST_ALPHAS alphas; else the ring."""
    if not (p >= 4 and 0 < b <= most and p * b <= BRUCK_MOST_BYTES):
        return "ring"
    return "bruck" if link is None or b * link.beta * share <= BRUCK_MOST_ALPHAS * link.alpha else "ring"


# reduce_scatter ------------------------------------------------------------------------------------------------

def reduce_scatter_ring(H: int, L: int, b: float, net: Link, shm: Link = SHM) -> float:
    return (H * L - 1) * _ring_step(H, L, b, net, shm)


def reduce_scatter_halving(H: int, L: int, b: float, net: Link, shm: Link = SHM) -> float | None:
    """reduce_scatter_halving: on pof2 virtual ranks (rem = p - pof2; virtual v < rem is rank 2v+1 and holds the
    blocks 2v and 2v+1, the others rank v+rem and block v+rem): the blocks copied into one buffer (p b at shared
    memory's time per byte), the even ranks below 2 rem send it (p b) to the next (the fold), log2(pof2) halving
    steps, farthest partner first, each sending the blocks of the half of its range that the partner keeps, then
    the odd ones send block r-1 back (b)."""
    p = H * L
    if p < 2:
        return None
    pof2 = _pof2(p)
    rem = p - pof2

    def real(v: int) -> int:
        return 2 * v + 1 if v < rem else v + rem

    # bound[v]: the first block of virtual rank v's segment, bound[pof2] = p
    bound = [2 * v if v < rem else v + rem for v in range(pof2)] + [p]
    t = p * b * shm.beta  # the blocks copied into one buffer first
    if rem:
        t += _step(((r, r + 1, p * b) for r in range(0, 2 * rem, 2)), L, net, shm)
    ranges = [(0, pof2)] * pof2
    mask = pof2 // 2
    while mask:
        msgs = []
        for v in range(pof2):
            lo, hi = ranges[v]
            mid = (lo + hi) // 2
            upper = bool(v & mask)
            give = (lo, mid) if upper else (mid, hi)
            ranges[v] = (mid, hi) if upper else (lo, mid)
            msgs.append((real(v), real(v ^ mask), (bound[give[1]] - bound[give[0]]) * b))
        t += _step(msgs, L, net, shm)
        mask //= 2
    if rem:
        t += _step(((r, r - 1, b) for r in range(1, 2 * rem, 2)), L, net, shm)
    return t


def reduce_scatter_halving_nearest(H: int, L: int, b: float, net: Link, shm: Link = SHM) -> float | None:
    """Not in pycyxwiz: the halving with the nearest partner first (p a power of two): partner r ^ 1 gets p b/2,
    r ^ 2 p b/4, ...: the steps that cross hosts are the last, smallest ones."""
    p = H * L
    if not _is_pof2(p) or p < 2:
        return None
    k = _log2(p)
    steps = sum(_step(((r, r ^ (1 << j), p * b / 2 ** (j + 1)) for r in range(p)), L, net, shm) for j in range(k))
    return p * b * shm.beta + steps


def pick_reduce_scatter_flat(p: int, b: float, most: int) -> str:
    """reduce_scatter in reduce_scatter.cpp (no probe): recursive halving on 4 ranks or more (folded where p is
    not a power of two: Note [Reduce-scatter on a world that is not a power of two] in allreduce_hd.cpp), blocks
    up to `most`; else the ring."""
    return "halving" if p >= 4 and 0 < b <= most else "ring"


# broadcast -----------------------------------------------------------------------------------------------------

def broadcast_tree(H: int, L: int, n: float, net: Link, shm: Link = SHM) -> float:
    """Binomial tree from rank 0, farthest child first: rounds of mask = P/2, P/4, ..., 1 (P the power of two
    >= p), in each every rank that has the message sends it to rank + mask."""
    p, t = H * L, 0.0
    mask = (1 << math.ceil(math.log2(p))) // 2 if p > 1 else 0
    while mask:
        t += _step(((v, v + mask, n) for v in range(0, p, 2 * mask) if v + mask < p), L, net, shm)
        mask //= 2
    return t


def broadcast_chain(H: int, L: int, n: float, net: Link, shm: Link = SHM, chunk: int = 512 << 10) -> float:
    """Pipelined chain 0 -> 1 -> ... -> p-1 in chunks: the first chunk crosses every hop (H-1 between hosts), the
    others follow one hop time apart, the slowest hop's."""
    p = H * L
    if p < 2:
        return 0.0
    nc = max(1, math.ceil(n / chunk))
    c1 = min(n, chunk)
    first = (H - 1) * net.cost(c1) + (p - H) * shm.cost(c1)
    rest = (nc - 1) * _ring_step(H, L, (n - c1) / (nc - 1), net, shm) if nc > 1 else 0.0
    return first + rest


def broadcast_chain_best_chunk(H: int, L: int, n: float, net: Link, shm: Link = SHM) -> float:
    """The chain with the cheapest chunk of 4 KiB, 8 KiB, ... n (pycyxwiz takes CX_CHUNK_BYTES for every chunked
    algorithm at once; the default is 256 KiB-1 MiB)."""
    chunks = [4096 << k for k in range(max(1, math.ceil(math.log2(max(n, 4096) / 4096)) + 1))]
    return min(broadcast_chain(H, L, n, net, shm, c) for c in chunks)


def broadcast_star(H: int, L: int, n: float, net: Link, shm: Link = SHM) -> float | None:
    """The root to every rank at once, each reading it in one copy: one host, more than 2 ranks, above 64 KiB (its
    readers not slowing each other down, which the model does not count). Below, where it does not run, its p-1
    messages would go through the rings, which a term per message of the root's would have to count."""
    return shm.cost(n) if H == 1 and L > 2 and n > SMALL_BROADCAST else None


def broadcast_scatter_all_gather(H: int, L: int, n: float, net: Link, shm: Link = SHM) -> float:
    """Not in pycyxwiz (van de Geijn): a binomial scatter of n/p a rank (the subtree's share per message), then the
    ring all_gather of n/p blocks."""
    p, t = H * L, 0.0
    mask = (1 << math.ceil(math.log2(p))) // 2 if p > 1 else 0
    while mask:
        t += _step(((v, v + mask, n / p * min(mask, p - v - mask)) for v in range(0, p, 2 * mask) if v + mask < p),
                   L, net, shm)
        mask //= 2
    return t + all_gather_ring(H, L, n / p, net, shm)


# Note [Broadcast between hosts] in broadcast.cpp: the tree only where the model gives it at most this share of the
# chain's time (its root's sends share its link, which the model's tree does not count)
TREE_SHARE = 0.6


# Note [The chain's chunk between hosts] in broadcast.cpp: the chunk that minimises the chain's time on the link,
# in multiples of 4 KiB, at least this, at most the agreed chunk
LEAST_LINK_CHUNK = 16 << 10


def chunk_by_link(p: int, n: float, chunk: int, link: Link) -> int:
    """broadcast.cpp's chain_chunk_by_link: (p - 2 + k)(alpha + n/k beta) over k chunks is least at k = sqrt(n beta (p - 2)
    / alpha); the better of the whole numbers beside it, its chunk rounded up to 4 KiB, within [16 KiB, chunk]."""
    if not link.alpha > 0:
        return min(LEAST_LINK_CHUNK, chunk)

    def cost(k: float) -> float:
        return (p - 2 + k) * (link.alpha + n / k * link.beta)
    best = max(1.0, math.sqrt(n * link.beta * (p - 2) / link.alpha))
    k = math.floor(best) if cost(math.floor(best)) <= cost(math.ceil(best)) else math.ceil(best)
    c = (math.ceil(n / k) + 4095) // 4096 * 4096
    return min(max(c, min(LEAST_LINK_CHUNK, chunk)), chunk)


def tree_by_link(p: int, n: float, chunk: int, link: Link) -> bool:
    """broadcast.cpp's tree_by_link: the binomial tree's rounds against the chain's hops and chunks on `link`."""
    c = min(n, max(1, chunk))
    rounds = math.ceil(math.log2(p))
    return rounds * link.cost(n) <= TREE_SHARE * (p - 2 + math.ceil(n / c)) * link.cost(c)


def _by_link(p: int, n: float, a: Agreed, across_hosts: bool) -> str | None:
    """broadcast's and reduce's rule between hosts: among 3 ranks or more each on a host of its own with the link
    measured, above 64 KiB, the tree where tree_by_link gives it, else the chain in the link's chunks; None
    elsewhere."""
    if across_hosts and a.link is not None and p >= 3 and n > SMALL_BROADCAST:
        return "tree" if tree_by_link(p, n, chunk_by_link(p, n, a.chunk, a.link), a.link) else "chain"
    return None


def pick_broadcast_flat(p: int, n: float, a: Agreed, across_hosts: bool = False) -> str:
    """broadcast in broadcast.cpp: among 3 ranks or more each on a host of its own (`across_hosts`) with the link
    measured, above 64 KiB, the tree or the chain in the link's chunks by the link (tree_by_link); else the root to
    all (p > 2, above the tree's threshold, outside the 3 ranks' skip), the binomial tree up to 64 KiB, else the
    chain."""
    between = _by_link(p, n, a, across_hosts)
    if between:
        return between
    if a.star and p > 2 and n > SMALL_BROADCAST and not a.star_skip[0] <= n < a.star_skip[1]:
        return "star"
    return "tree" if n <= SMALL_BROADCAST else "chain"


def pick_reduce_flat(p: int, n: float, a: Agreed, across_hosts: bool = False) -> str:
    """reduce in reduce.cpp: among 3 ranks or more each on a host of its own with the link measured, above 64 KiB,
    broadcast's rule (the chain in the link's chunks, or the tree by tree_by_link); else the binomial tree."""
    return _by_link(p, n, a, across_hosts) or "tree"


# the three, flat and hierarchical ------------------------------------------------------------------------------

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce")
ROOTED = ("broadcast", "reduce")  # sized by the message n, hierarchical as the root's column and the hosts

FLAT_OPS: dict[str, dict[str, Callable[..., float | None]]] = {
    "all_gather": {"ring": all_gather_ring, "bruck": all_gather_bruck, "rd": all_gather_recursive_doubling},
    "reduce_scatter": {"ring": reduce_scatter_ring, "halving": reduce_scatter_halving,
                       "halving-near": reduce_scatter_halving_nearest},
    "broadcast": {"tree": broadcast_tree, "chain": broadcast_chain, "star": broadcast_star,
                  "vdg": broadcast_scatter_all_gather, "chain*": broadcast_chain_best_chunk},
    "reduce": {"tree": broadcast_tree, "chain": broadcast_chain, "chain*": broadcast_chain_best_chunk},
}


def _flat_op(op: str, name: str, H: int, L: int, x: float, net: Link, shm: Link, a: Agreed) -> float | None:
    if name == "bruck" and H * L * x > BRUCK_MOST_BYTES:
        return None  # its scratch is capped: "bruck-nocap" is the not implemented one
    if name == "bruck-nocap":
        return all_gather_bruck(H, L, x, net, shm) if H * L * x > BRUCK_MOST_BYTES else None
    if name == "chain":  # between hosts of a rank each, with the link measured: its chunk by the link
        link = a.link if L == 1 and H >= 3 else None
        return broadcast_chain(H, L, x, net, shm, chunk_by_link(H, x, a.chunk, link) if link else a.chunk)
    return FLAT_OPS[op][name](H, L, x, net, shm)


def hierarchical_op(op: str, across: str, inner: str, H: int, L: int, x: float, net: Link, shm: Link = SHM,
                    a: Agreed | None = None) -> float | None:
    """hierarchical.cpp's reduce_scatter, all_gather and broadcast; `inner`: the flat algorithm inside a host,
    `across`: "direct" (up to 8 hosts) or the flat algorithm of the columns (above 8, and broadcast's).

    all_gather, direct: each rank posts its block to its column's H-1 peers at once (the NIC carries L(H-1) b each
    way, all arriving together: alpha_n + L(H-1) b beta_n), and gathers inside the host H times, its own host's
    blocks first: max(g, that) + (H-1) g, g the gather of L blocks of b. Above 8 hosts the columns' all_gather (all
    L at once through the NIC) and then the H gathers: + H g.
    reduce_scatter, direct: H reduce-scatters inside the host (g each), the other hosts' first, each sum posted to
    its host at once: max(H g, g + alpha_n + L(H-1) b beta_n, (H-1) g + alpha_n + L b beta_n). Above 8 hosts, H g
    and then the columns' reduce_scatter.
    broadcast: the root's column (one rank a host) then inside every host, one after the other."""
    a = a or agreed(H, L)
    if H < 2 or op not in ROOTED and (across == "direct") != (H <= PIPELINED_MAX_HOSTS):
        return None
    in_host = _flat_op(op, inner, 1, L, x, shm, shm, a)
    if in_host is None:
        return None
    g = in_host if L > 1 else 0.0
    if op in ROOTED:
        t = _flat_op(op, across, H, 1, x, net, shm, a)
        return None if t is None else t + g
    if across == "direct":
        if op == "all_gather":
            return max(g, net.cost(L * (H - 1) * x)) + (H - 1) * g
        return max(H * g, g + net.cost(L * (H - 1) * x), (H - 1) * g + net.cost(L * x))
    wide = Link(net.alpha, net.beta * L)  # the L columns at once through every host's NIC
    t = _flat_op(op, across, H, 1, x, wide, shm, a)
    return None if t is None else t + H * g


def picked_all_gather(H: int, L: int, b: float, a: Agreed | None = None, algorithm: str = "auto") -> str:
    """What pycyxwiz runs for blocks of b bytes (CpuBackend::all_gather): hierarchical across hosts of several
    ranks once the whole result is 32 KiB (`algorithm`: CX_ALGORITHM, "auto", "flat" or "hierarchical")."""
    a = a or agreed(H, L)
    if _goes_hierarchical(H, L, H * L * b, HIERARCHICAL_FROM, algorithm):
        inner = pick_all_gather_flat(L, b, a.in_host_all_gather)
        across = "direct" if H <= PIPELINED_MAX_HOSTS else pick_all_gather_flat(H, b, a.all_gather, a.link, L)
        return f"hier/{across}/{inner}"
    return pick_all_gather_flat(H * L, b, a.all_gather, a.link if L == 1 else None)


def picked_reduce_scatter(H: int, L: int, b: float, a: Agreed | None = None, algorithm: str = "auto") -> str:
    """What pycyxwiz runs for blocks of b bytes (CpuBackend::reduce_scatter, no probe): as picked_all_gather."""
    a = a or agreed(H, L)
    if _goes_hierarchical(H, L, H * L * b, HIERARCHICAL_FROM, algorithm):
        inner = pick_reduce_scatter_flat(L, b, a.in_host_reduce_scatter)
        across = "direct" if H <= PIPELINED_MAX_HOSTS else pick_reduce_scatter_flat(H, b, a.reduce_scatter)
        return f"hier/{across}/{inner}"
    return pick_reduce_scatter_flat(H * L, b, a.reduce_scatter)


def picked_broadcast(H: int, L: int, n: float, a: Agreed | None = None, algorithm: str = "auto") -> str:
    """What pycyxwiz runs for n bytes (CpuBackend::broadcast): hierarchical from the tree's threshold (64 KiB) up,
    the world's options inside the hosts too (the root to all is off: it was agreed by every pair, some between
    hosts)."""
    a = a or agreed(H, L)
    if _goes_hierarchical(H, L, n, SMALL_BROADCAST, algorithm):
        return f"hier/{pick_broadcast_flat(H, n, a, across_hosts=True)}/{pick_broadcast_flat(L, n, a)}"
    return pick_broadcast_flat(H * L, n, a, across_hosts=L == 1)


def _goes_hierarchical(H: int, L: int, nbytes: float, from_bytes: int, algorithm: str) -> bool:
    """CpuBackend::hierarchical: a Hierarchy where it pays (several hosts of several ranks) or forced."""
    if algorithm == "flat" or H < 2:
        return False
    return algorithm == "hierarchical" or (L > 1 and nbytes >= from_bytes)


def picked_reduce(H: int, L: int, n: float, a: Agreed | None = None, algorithm: str = "auto") -> str:
    """What pycyxwiz runs for n bytes (CpuBackend::reduce): hierarchical from 64 KiB up, as broadcast (the tree
    inside a host, the column by pick_reduce_flat)."""
    a = a or agreed(H, L)
    if _goes_hierarchical(H, L, n, SMALL_BROADCAST, algorithm):
        return f"hier/{pick_reduce_flat(H, n, a, across_hosts=True)}/tree"
    return pick_reduce_flat(H * L, n, a, across_hosts=L == 1)


PICKED = {"all_gather": picked_all_gather, "reduce_scatter": picked_reduce_scatter, "broadcast": picked_broadcast,
          "reduce": picked_reduce}


def op_cost(op: str, name: str, H: int, L: int, x: float, net: Link, shm: Link = SHM,
            a: Agreed | None = None) -> float | None:
    """The cost of algorithm `name` ("ring", "bruck", ..., "hier/<across>/<inner>") of `op`; None where it cannot
    run there."""
    a = a or agreed(H, L)
    if H * L == 1:
        return 0.0
    if name.startswith("hier/"):
        _, across, inner = name.split("/")
        return hierarchical_op(op, across, inner, H, L, x, net, shm, a)
    return _flat_op(op, name, H, L, x, net, shm, a)


OP_FLAT = {"all_gather": ("ring", "bruck"), "reduce_scatter": ("ring", "halving"),
           "broadcast": ("tree", "chain", "star"), "reduce": ("tree", "chain")}
OP_NOT_IMPLEMENTED = {"all_gather": ("bruck-nocap", "rd"), "reduce_scatter": ("halving-near",),
                      "broadcast": ("vdg", "chain*"), "reduce": ("chain*",)}


def op_candidates(op: str, H: int, L: int, implemented_only: bool = True) -> list[str]:
    names = list(OP_FLAT[op]) + ([] if implemented_only else list(OP_NOT_IMPLEMENTED[op]))
    if H > 1 and L > 1:
        inners = [n for n in OP_FLAT[op] if n != "star"]
        if op in ROOTED:
            acrosses = inners
        else:
            acrosses = ["direct"] if H <= PIPELINED_MAX_HOSTS else inners
        names += [f"hier/{x}/{i}" for x in acrosses for i in inners]
    return names


def op_best(op: str, H: int, L: int, x: float, net: Link, shm: Link = SHM, implemented_only: bool = True,
            a: Agreed | None = None) -> tuple[str, float]:
    costs = [(c, op_cost(op, c, H, L, x, net, shm, a)) for c in op_candidates(op, H, L, implemented_only)]
    return min(((c, t) for c, t in costs if t is not None), key=lambda ct: ct[1])


OP_SHORT = {"ring": "ring", "bruck": "Bruck", "bruck-nocap": "Bruck (no 64 MiB cap)", "rd": "RD",
            "halving": "halving", "halving-near": "halving-near", "tree": "tree", "chain": "chain", "star": "star",
            "vdg": "scatter+AG", "chain*": "chain (best chunk)", "direct": "direct"}


def op_short(name: str) -> str:
    if name.startswith("hier/"):
        _, across, inner = name.split("/")
        return f"hier({OP_SHORT[across]}, {OP_SHORT[inner]})"
    return OP_SHORT[name]


OP_SIZES = {"all_gather": (8, 1 << 10, 8 << 10, 16 << 10, 128 << 10, 1 << 20, 16 << 20),
            "reduce_scatter": (8, 1 << 10, 8 << 10, 16 << 10, 128 << 10, 1 << 20, 16 << 20),
            "broadcast": (8, 64 << 10, 1 << 20, 16 << 20, 256 << 20),
            "reduce": (8, 64 << 10, 1 << 20, 16 << 20, 256 << 20)}


def op_scale_table(op: str, per_host: int = 8, gbits=(10, 100), ranks=(8, 64, 1024), sizes=None,
                   alpha: float = 20e-6) -> tuple[list, list]:
    """As scale_table, for all_gather, reduce_scatter (size: each rank's block, and the whole), broadcast or reduce."""
    sizes = sizes or OP_SIZES[op]
    headers = ["Gbit/s", "ranks", "hosts x ranks", "block (whole)" if op not in ROOTED else "size",
               "pycyxwiz picks", "its time", "best (implemented)", "best time", "picked/best",
               "best of all (incl. not implemented)"]
    rows = []
    for g in gbits:
        net = nic(g, alpha)
        for p in ranks:
            H, L = max(1, p // per_host), min(per_host, p)
            a = agreed(H, L, net=net)
            for x in sizes:
                pick = PICKED[op](H, L, x, a)
                tp = op_cost(op, pick, H, L, x, net, SHM, a)
                assert tp is not None, (op, pick, H, L, x)
                b, tb = op_best(op, H, L, x, net, SHM, True, a)
                ba, ta = op_best(op, H, L, x, net, SHM, False, a)
                size = human_size(x) if op in ROOTED else f"{human_size(x)} ({_size(p * x)})"
                rows.append([str(g), str(p), f"{H}x{L}", size, op_short(pick), f"{tp * 1e3:.3f} ms", op_short(b),
                             f"{tb * 1e3:.3f} ms", f"{tp / tb:.2f}x", f"{op_short(ba)} {ta * 1e3:.3f} ms"])
    return headers, rows


def _size(n: float) -> str:
    """human_size for any size, three digits: 8 GiB, 21.3 KiB."""
    for name, unit in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= unit:
            return f"{n / unit:.3g} {name}"
    return f"{n:.3g} B"


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


def validate(link: str, points, sizes, log=print, op: str = "all_reduce") -> dict:
    """Every (hosts, ranks per host, algorithm column) in `points` at every size: measured against predicted. Sizes
    as benchmarks._collective_worker takes them: all_gather's the whole result, reduce_scatter's the whole input
    (each rank's block: size/p, in float32 elements)."""
    from benchmarks._launch import run_ranks

    net, shm = measure_link(link, log), measure_link(None, log)
    rows, out = [], []
    for H, L, col in points:
        lib = {"flat": "pycyxwiz-flat", "hier": "pycyxwiz-hier"}[col]
        run = run_ranks(lib, "benchmarks._collective_worker",
                        ["--op", op, "--iters-scale", "0.3", "--sizes", *map(str, sizes)], H * L, 600,
                        link=link, per_host=L)
        for n in sizes:
            t = _median_time(run, n)
            if op == "all_reduce":
                th = Thresholds()
                measured = net if H >= 3 else None  # what rank 0 measures at init (Note [Choosing by the link])
                name = ((("hier-pipe" if pipelines(H, L, n, th) else
                          "hierarchical/" + th.flat(H * L, n / L, H, measured, L)))
                        if col == "hier" else th.flat(H * L, n, None, measured if L == 1 else None))
                pred = cost(name, H, L, n, net, shm)
                x, shown = n, short(name)
            else:
                x = n if op in ROOTED else max(1, n // 4 // (H * L)) * 4  # _counts in _collective_worker.py
                a = agreed(H, L, net=net)
                name = PICKED[op](H, L, x, a, "hierarchical" if col == "hier" else "flat")
                pred = op_cost(op, name, H, L, x, net, shm, a)
                shown = op_short(name)
            err = (pred / t - 1) if t and pred is not None else None
            out.append({"hosts": H, "per_host": L, "column": col, "algorithm": name, "bytes": n, "block_bytes": x,
                        "measured_s": t, "predicted_s": pred, "error": err, "reason": run.reason})
            block = [] if op in ("all_reduce", *ROOTED) else [_size(x)]
            ms = "{:.1f} ms" if op == "all_reduce" else "{:.3g} ms"  # three digits where 64 KiB takes 0.2 ms
            rows.append([f"{H}x{L}", col, shown, human_size(n), *block,
                         ms.format(t * 1e3) if t else f"n/a ({run.reason})",
                         ms.format(pred * 1e3) if pred is not None else "n/a",
                         f"{100 * err:+.0f}%" if err is not None else ""])
            log(f"  {H}x{L} {col} {human_size(n)}: " + " ".join(rows[-1][-3:]))
    block_header = [] if op in ("all_reduce", *ROOTED) else ["block"]
    return {"op": op, "link": link, "alpha_s": net.alpha, "beta_s_per_byte": net.beta, "shm_alpha_s": shm.alpha,
            "shm_beta_s_per_byte": shm.beta, "points": out,
            "table": format_table(["hosts x ranks", "column", "algorithm", "size", *block_header, "measured",
                                   "predicted", "error"], rows, markdown=True)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--table", action="store_true", help="the choice at scale (markdown)")
    ap.add_argument("--validate", action="store_true", help="measure links and runs, compare with the model")
    ap.add_argument("--op", choices=OPS, default="all_reduce", help="the collective (default all_reduce)")
    ap.add_argument("--link", default="1gbit")
    ap.add_argument("--alpha-us", type=float, default=20.0, help="the NIC's alpha in the scale table")
    ap.add_argument("--per-host", type=int, default=8, help="ranks per host in the scale table")
    ap.add_argument("--sizes", nargs="+", type=int, default=[1 << 20, 16 << 20, 64 << 20],
                    help="--validate's sizes in bytes, as benchmarks._collective_worker takes them (all_gather: "
                         "the whole result, reduce_scatter: the whole input)")
    a = ap.parse_args(argv)
    payload: dict = {"benchmark": "cost_model", "op": a.op}
    if a.validate:
        points = [(2, 1, "flat"), (3, 1, "flat"), (4, 1, "flat"), (2, 2, "flat"), (2, 2, "hier")]
        payload["validation"] = validate(a.link, points, a.sizes, op=a.op)
        print(payload["validation"]["table"])
    if a.table or not a.validate:
        if a.op == "all_reduce":
            headers, rows = scale_table(per_host=a.per_host, alpha=a.alpha_us * 1e-6)
        else:
            headers, rows = op_scale_table(a.op, per_host=a.per_host, alpha=a.alpha_us * 1e-6)
        payload["scale"] = {"headers": headers, "rows": rows, "per_host": a.per_host, "alpha_us": a.alpha_us}
        print(format_table(headers, rows, markdown=True))
    name = "cost_model" if a.op == "all_reduce" else f"cost_model_{a.op}"
    print(f"\nwrote {write_json(name, payload)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
