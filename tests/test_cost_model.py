"""benchmarks/cost_model.py: its picks follow the C++'s rules (cpu_backend.cpp, allgather.cpp, reduce_scatter.cpp,
broadcast.cpp, hierarchical.cpp) and its formulas count what the algorithms send. Pure Python, no processes."""
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import cost_model as cm  # noqa: E402

KiB, MiB = 1 << 10, 1 << 20
ALPHA = cm.Link(alpha=1.0, beta=0.0)   # every message costs 1, bytes nothing: the steps
BETA = cm.Link(alpha=0.0, beta=1.0)    # every byte costs 1: the bytes on the busiest link
FREE = cm.Link(alpha=0.0, beta=0.0)


# ---- the picks -------------------------------------------------------------------------------------------------

def test_all_gather_on_four_ranks_of_one_host_is_bruck_up_to_8_kib_blocks():
    assert cm.picked_all_gather(1, 4, 1 * KiB) == "bruck"
    assert cm.picked_all_gather(1, 4, 8 * KiB) == "bruck"
    assert cm.picked_all_gather(1, 4, 8 * KiB + 4) == "ring"


def test_all_gather_on_two_or_three_ranks_is_the_ring():
    assert cm.picked_all_gather(1, 3, 8) == "ring"
    assert cm.picked_all_gather(3, 1, 8) == "ring"
    assert cm.picked_all_gather(2, 1, 8) == "ring"


def test_all_gather_where_sockets_carry_a_pair_is_bruck_up_to_128_kib_blocks():
    assert cm.picked_all_gather(4, 1, 128 * KiB) == "bruck"
    assert cm.picked_all_gather(4, 1, 128 * KiB + 4) == "ring"
    assert cm.picked_all_gather(1, 4, 128 * KiB, cm.agreed(1, 4, shm_on=False)) == "bruck"


def test_bruck_stops_where_its_whole_result_passes_64_mib():
    assert cm.picked_all_gather(1024, 1, 8 * KiB) == "bruck"  # 8 MiB: above the kept scratch, in one of the call's
    assert cm.picked_all_gather(512, 1, 128 * KiB) == "bruck"  # 64 MiB exactly
    assert cm.picked_all_gather(1024, 1, 128 * KiB) == "ring"


def test_bruck_between_hosts_of_a_rank_each_takes_blocks_of_at_most_16_link_alphas():
    # Note [Bruck's all_gather between hosts] in allgather.cpp: 1 Gbit/s with 12 us: 16 alphas are 23 KB
    net = cm.Link(alpha=12e-6, beta=8 / 1e9)
    assert cm.picked_all_gather(4, 1, 16 * KiB, cm.agreed(4, 1, net=net)) == "bruck"
    assert cm.picked_all_gather(4, 1, 64 * KiB, cm.agreed(4, 1, net=net)) == "ring"
    assert cm.picked_all_gather(4, 1, 64 * KiB) == "bruck"  # no link measured: the loopback bound
    assert cm.picked_all_gather(64, 1, 128 * KiB, cm.agreed(64, 1, net=cm.nic(10))) == "bruck"  # 400 KB at 10 Gbit/s
    assert cm.picked_all_gather(2, 2, 16 * KiB, cm.agreed(2, 2, net=net), "flat") == "bruck"  # 2 hosts: not measured


def test_broadcast_between_hosts_takes_the_tree_only_where_the_model_gives_it_at_most_0_6_of_the_chain():
    # Note [Broadcast between hosts] in broadcast.cpp: the link is measured from 3 hosts up; the chain's chunk is the
    # link's (Note [The chain's chunk between hosts])
    for gbit in (1, 10, 100):
        net = cm.nic(gbit)
        for n in (128 * KiB, 1 * MiB, 16 * MiB):  # never on 3 or 4 hosts
            assert cm.picked_broadcast(3, 1, n, cm.agreed(3, 1, net=net)) == "chain"
            assert cm.picked_broadcast(4, 1, n, cm.agreed(4, 1, net=net)) == "chain"
        assert cm.picked_broadcast(8, 1, 16 * MiB, cm.agreed(8, 1, net=net)) == "chain"
        assert cm.picked_broadcast(1024, 1, 1 * MiB, cm.agreed(1024, 1, net=net)) == "tree"
    for gbit in (1, 10):  # 8 hosts: the chain in chunks of 16-48 KiB beats the tree's 3 rounds of the whole
        assert cm.picked_broadcast(8, 1, 512 * KiB, cm.agreed(8, 1, net=cm.nic(gbit))) == "chain"
    assert cm.picked_broadcast(8, 1, 128 * KiB, cm.agreed(8, 1, net=cm.nic(100))) == "tree"  # alpha is most of it
    net = cm.nic(10)
    assert cm.picked_broadcast(512, 8, 1 * MiB, cm.agreed(512, 8, net=net)) == "hier/tree/chain"  # the column
    assert cm.picked_broadcast(2, 1, 1 * MiB, cm.agreed(2, 1, net=net)) == "chain"  # 2 hosts: nothing measured
    assert cm.picked_broadcast(8, 1, 1 * MiB) == "chain"  # no link given: the loopback rule


def test_reduce_scatter_on_8_ranks_over_sockets_is_halving_up_to_16_kib_blocks():
    assert cm.picked_reduce_scatter(8, 1, 1 * KiB) == "halving"
    assert cm.picked_reduce_scatter(8, 1, 16 * KiB) == "halving"
    assert cm.picked_reduce_scatter(8, 1, 16 * KiB + 4) == "ring"


def test_reduce_scatter_through_rings_is_halving_up_to_1_kib_blocks():
    assert cm.picked_reduce_scatter(1, 8, 1 * KiB) == "halving"
    assert cm.picked_reduce_scatter(1, 8, 1 * KiB + 4) == "ring"


@pytest.mark.parametrize("p, algorithm", [(2, "ring"), (3, "ring"), (4, "halving"), (5, "halving"),
                                          (6, "halving"), (7, "halving"), (8, "halving"), (12, "halving")])
def test_reduce_scatter_halves_from_4_ranks_folding_those_that_are_not_a_power_of_two(p, algorithm):
    assert cm.picked_reduce_scatter(p, 1, 1 * KiB) == algorithm


def test_all_gather_and_reduce_scatter_go_hierarchical_from_32_kib_of_the_whole():
    # 2 hosts of 4: 8 blocks of 2 KiB make 16 KiB, of 4 KiB 32 KiB
    assert cm.picked_all_gather(2, 4, 2 * KiB) == "bruck"            # flat, sockets' threshold
    assert cm.picked_all_gather(2, 4, 4 * KiB) == "hier/direct/bruck"  # in-host: rings' 8 KiB
    assert cm.picked_all_gather(2, 4, 16 * KiB) == "hier/direct/ring"
    assert cm.picked_reduce_scatter(2, 4, 2 * KiB) == "halving"      # flat, sockets' 16 KiB
    assert cm.picked_reduce_scatter(2, 4, 4 * KiB) == "hier/direct/ring"  # in-host: rings' 1 KiB
    assert cm.picked_reduce_scatter(8, 4, 1 * KiB) == "hier/direct/halving"


def test_above_8_hosts_the_columns_run_the_flat_algorithms_with_the_worlds_thresholds():
    assert cm.picked_all_gather(16, 8, 1 * KiB) == "hier/bruck/bruck"
    assert cm.picked_all_gather(16, 8, 16 * KiB) == "hier/bruck/ring"
    assert cm.picked_reduce_scatter(16, 8, 16 * KiB) == "hier/halving/ring"
    assert cm.picked_reduce_scatter(9, 8, 16 * KiB + 4) == "hier/ring/ring"


def test_cx_algorithm_forces_the_hierarchy_or_keeps_it_flat():
    assert cm.picked_all_gather(2, 2, 8, algorithm="hierarchical") == "hier/direct/ring"
    assert cm.picked_reduce_scatter(2, 2, 16 * MiB, algorithm="flat") == "ring"
    assert cm.picked_broadcast(2, 2, 16 * MiB, algorithm="flat") == "chain"


def test_broadcast_on_one_host_goes_from_the_root_to_all_above_64_kib():
    assert cm.picked_broadcast(1, 8, 64 * KiB) == "tree"
    assert cm.picked_broadcast(1, 8, 64 * KiB + 4) == "star"
    assert cm.picked_broadcast(1, 2, 1 * MiB) == "chain"  # two ranks keep the chain
    assert cm.picked_broadcast(1, 8, 1 * MiB, cm.agreed(1, 8, single_copies=False)) == "chain"


def test_broadcast_on_three_ranks_keeps_the_chain_from_768_kib_to_4_mib():
    assert cm.picked_broadcast(1, 3, 512 * KiB) == "star"
    assert cm.picked_broadcast(1, 3, 768 * KiB) == "chain"
    assert cm.picked_broadcast(1, 3, 4 * MiB) == "star"


def test_broadcast_across_hosts_is_hierarchical_from_64_kib_without_the_star():
    assert cm.picked_broadcast(2, 4, 32 * KiB) == "tree"
    assert cm.picked_broadcast(2, 4, 64 * KiB) == "hier/tree/tree"
    assert cm.picked_broadcast(2, 4, 1 * MiB) == "hier/chain/chain"
    assert cm.picked_broadcast(4, 1, 1 * MiB) == "chain"  # one rank a host: flat


def test_two_ranks_keep_the_default_thresholds():
    assert cm.agreed(2, 1) == cm.Agreed(chunk=512 * KiB)
    assert cm.agreed(1, 8).chunk == 256 * KiB


# ---- the formulas ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("p", [2, 3, 4, 5, 8, 1000])
def test_the_ring_all_gather_takes_p_minus_1_steps_and_bruck_ceil_log2_p(p):
    assert cm.all_gather_ring(p, 1, 8, ALPHA, FREE) == p - 1
    assert cm.all_gather_ring(1, p, 8, FREE, ALPHA) == p - 1
    assert cm.all_gather_bruck(p, 1, 8, ALPHA, FREE) == math.ceil(math.log2(p))
    assert cm.reduce_scatter_ring(p, 1, 8, ALPHA, FREE) == p - 1


@pytest.mark.parametrize("p", [2, 3, 5, 8, 1000])
def test_bruck_and_the_ring_send_the_same_bytes_each_and_bruck_copies_the_whole(p):
    assert cm.all_gather_ring(p, 1, 8, BETA, FREE) == (p - 1) * 8
    assert cm.all_gather_bruck(p, 1, 8, BETA, FREE) == (p - 1) * 8
    assert cm.all_gather_bruck(1, p, 8, FREE, BETA) == (p - 1) * 8 + p * 8  # through shared memory, + its copy


@pytest.mark.parametrize("p, steps", [(4, 2), (8, 3), (1024, 10), (5, 4), (6, 4), (7, 4), (12, 5)])
def test_halving_takes_log2_pof2_steps_and_two_more_to_fold(p, steps):
    assert cm.reduce_scatter_halving(p, 1, 8, ALPHA, FREE) == steps


def test_halving_on_a_power_of_two_sends_the_rings_bytes():
    assert cm.reduce_scatter_halving(8, 1, 8, BETA, FREE) == 7 * 8


def test_halving_on_6_ranks_folds_the_whole_input_in_and_a_block_out():
    # fold in: 6 b; virtual ranks 0 and 1 (ranks 1 and 3) hold 2 blocks each, 2 and 3 (ranks 4, 5) one:
    # mask 2: virtual 2 gives virtual 0 and 1's blocks, 4 b; mask 1: virtual 0 gives virtual 1's, 2 b; fold out: b
    assert cm.reduce_scatter_halving(6, 1, 1, BETA, FREE) == 6 + 4 + 2 + 1


def test_a_step_costs_the_busiest_nic_with_every_rank_of_the_host_that_crosses():
    # 2 hosts of 4, halving of 8 ranks: the first exchange (r ^ 4) puts 4 ranks x 4 blocks through each NIC
    assert cm.reduce_scatter_halving(2, 4, 1, BETA, FREE) == 16
    # Bruck at distance 1 on 2 hosts of 4: one rank a host crosses, at distance 2 two with 2 blocks, at 4 all four
    assert cm.all_gather_bruck(2, 4, 1, BETA, FREE) == 1 + 2 * 2 + 4 * 4


@pytest.mark.parametrize("p, rounds", [(2, 1), (5, 3), (8, 3), (1000, 10)])
def test_the_binomial_broadcast_takes_ceil_log2_p_rounds(p, rounds):
    assert cm.broadcast_tree(p, 1, 8, ALPHA, FREE) == rounds


def test_reduce_takes_broadcasts_rule_between_hosts_and_the_tree_elsewhere():
    # Note [Reduce between hosts] in reduce.cpp, Note [Reduce across hosts of several ranks] in hierarchical.cpp
    net = cm.nic(1, alpha=12e-6)
    for H in (3, 4, 8):
        assert cm.picked_reduce(H, 1, 64 * KiB, cm.agreed(H, 1, net=net)) == "tree"  # the threshold: at or below
        assert cm.picked_reduce(H, 1, 128 * KiB, cm.agreed(H, 1, net=net)) == "chain"
        assert cm.picked_reduce(H, 2, 1 * MiB, cm.agreed(H, 2, net=net)) == "hier/chain/tree"  # the root's column
    assert cm.picked_reduce(2, 1, 1 * MiB, cm.agreed(2, 1, net=net)) == "tree"  # 2 hosts: nothing measured
    assert cm.picked_reduce(2, 2, 1 * MiB, cm.agreed(2, 2, net=net)) == "hier/tree/tree"
    assert cm.picked_reduce(2, 2, 32 * KiB) == "tree"  # below 64 KiB: flat
    assert cm.picked_reduce(1, 4, 16 * MiB) == "tree"  # one host: the tree at every size
    assert cm.picked_reduce(1024, 1, 1 * MiB, cm.agreed(1024, 1, net=cm.nic(10))) == "tree"  # 10 rounds, 1022 hops
    # the chain's and the tree's messages are broadcast's the other way round: the same bytes through each NIC
    assert cm.op_cost("reduce", "tree", 8, 1, 1 * MiB, net) == cm.op_cost("broadcast", "tree", 8, 1, 1 * MiB, net)
    assert cm.op_cost("reduce", "tree", 8, 1, 1 * MiB, net) == pytest.approx(3 * net.cost(1 * MiB))


def test_the_chains_chunk_between_hosts_is_the_best_whole_number_of_chunks_within_16_kib_and_the_agreed_chunk():
    net = cm.nic(1, alpha=12e-6)  # as measured behind the namespaces' 1 Gbit/s links
    for p in (3, 8, 64):
        for n in (100_000, 1 * MiB, 16 * MiB):
            c = cm.chunk_by_link(p, n, 512 * KiB, net)
            assert c % 4096 == 0 and 16 * KiB <= c <= 512 * KiB
            k = math.ceil(n / c)
            chain = (p - 2 + k) * net.cost(n / k)
            best = min((p - 2 + j) * net.cost(n / j) for j in range(1, 4096))
            if 16 * KiB < c < 512 * KiB:  # not clamped: within the 4 KiB rounding of the best
                assert chain <= best * 1.02, (p, n, c)
    assert cm.chunk_by_link(8, 16 * MiB, 512 * KiB, net) == 64 * KiB
    assert cm.chunk_by_link(3, 1 * MiB, 512 * KiB, net) == 40 * KiB
    assert cm.chunk_by_link(8, 1 * MiB, 512 * KiB, net) == 16 * KiB     # the least
    assert cm.chunk_by_link(3, 256 * MiB, 512 * KiB, net) == 512 * KiB   # the agreed chunk at most
    assert cm.chunk_by_link(3, 256 * MiB, 64 * KiB, net) == 64 * KiB


def test_the_chain_takes_p_minus_1_hops_then_a_hop_per_further_chunk():
    assert cm.broadcast_chain(1, 4, 4 * KiB, FREE, ALPHA, chunk=KiB) == 3 + 3
    assert cm.broadcast_chain(4, 1, 4 * KiB, BETA, FREE, chunk=KiB) == 3 * KiB + 3 * KiB


def test_the_hierarchical_all_gather_on_2_hosts_puts_every_column_through_the_nic_at_once():
    # 2 hosts of 2, shared memory free: the L blocks of a host cross once, L b
    assert cm.hierarchical_op("all_gather", "direct", "ring", 2, 2, 8, BETA, FREE) == 2 * 8
    assert cm.hierarchical_op("reduce_scatter", "direct", "ring", 2, 2, 8, BETA, FREE) == 2 * 8
    assert cm.hierarchical_op("all_gather", "direct", "ring", 9, 2, 8, BETA, FREE) is None  # sequential above 8


def test_every_pick_is_among_the_candidates_and_no_cheaper_than_the_best():
    for op in ("all_gather", "reduce_scatter", "broadcast"):
        for per_host in (1, 8):
            _, rows = cm.op_scale_table(op, per_host=per_host)
            assert all(float(r[8].rstrip("x")) >= 1.0 for r in rows), (op, per_host)


def test_the_all_reduce_table_keeps_its_columns():
    headers, rows = cm.scale_table()
    assert headers[3] == "pycyxwiz picks" and len(rows) == 30
