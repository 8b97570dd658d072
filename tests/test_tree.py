"""Shared-prefix packing: the trie layout by hand, and log-probs and gradients equal to the unshared
packing on random forests (tiny fp32 models, CPU).

Tolerances: the forest runs the same model on fewer rows, with a boolean-mask ``sdpa`` per tree
instead of a causal ``sdpa`` per sequence, so results differ by fp32 rounding only (measured
≤ 1e-6 on log-probs of ≈ -6, ≤ 5e-6 on gradients of magnitude up to ≈ 10). An attention leak (a
node reading a sibling branch) or a log-prob read from the wrong node moves log-probs by > 1e-2
(checked below), so 1e-5 separates right from wrong.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from areal_async.trainer.attention import _sdpa_per_tree, tree_mask_mod, use_packed_attention
from areal_async.trainer.packed_policy import PackedPolicy, packed_logprobs
from areal_async.trainer.packing import pack_sequences
from areal_async.trainer.tree import chain_layout, cut_units, pack_tree, unique_tokens

torch.set_num_threads(1)


def test_pack_tree_layout_by_hand():
    # Sorted: s2=[5,6], s0=[5,6,7,8], s3=[5,6,7,8] (equal to s0), s1=[5,6,9], s4=[7] (own tree).
    # Nodes in pre-order: 0:5 1:6 (from s2), 2:7 3:8 (s0 adds after lcp 2), nothing for s3 (lcp 4),
    # 4:9 (s1, lcp 2), 5:7 (s4, lcp 0: a new tree). Depths 0 1 2 3 2 0.
    # Subtrees: node 0 holds 0..4 (end 5), node 1 also 5, nodes 2, 3 end at 4, node 4 at 5, node 5 at 6.
    seqs = [[5, 6, 7, 8], [5, 6, 9], [5, 6], [5, 6, 7, 8], [7]]
    t = pack_tree(seqs)
    assert t.input_ids.tolist() == [5, 6, 7, 8, 9, 7]
    assert t.position_ids.tolist() == [0, 1, 2, 3, 2, 0]
    assert t.subtree_end.tolist() == [5, 5, 4, 4, 5, 6]
    assert t.cu_trees.tolist() == [0, 5, 6] and t.max_tree_len == 5 and t.num_tokens == 6
    assert unique_tokens(seqs) == 6
    # Log-prob rows: every position with a next token, in the unshared layout (s0 at 0..3, s1 at
    # 4..6, s2 at 7..8, s3 at 9..12, s4 at 13). Node 1 (token 6) predicts 7 for s0 and s3 and 9
    # for s1: one row per reading sequence, each with its own label, none at a sequence's end.
    assert t.head_index.tolist() == [0, 1, 2, 4, 5, 7, 9, 10, 11]
    assert t.head_nodes.tolist() == [0, 1, 2, 0, 1, 0, 0, 1, 2]
    assert t.head_labels.tolist() == [6, 7, 8, 6, 9, 6, 6, 7, 8]
    assert t.num_seq_tokens == 14
    with pytest.raises(ValueError, match="head_index 3 is not a position with a next token"):
        pack_tree(seqs, torch.tensor([0, 3]))
    with pytest.raises(ValueError, match="sequence 1 is empty"):
        pack_tree([[1], []])


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_tree_attention_mask_is_the_ancestor_path():
    # the per-tree sdpa equals sdpa over the whole row with mask[i, j] = j is on i's root path
    # (node j's tokens are a prefix of node i's; derived without subtree_end); and FlexAttention under
    # tree_mask_mod (the CUDA path's mask, evaluated eagerly on the CPU) equals both
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    seqs = [[5, 6, 7, 8], [5, 6, 9], [5, 6], [5, 6, 7, 8, 1, 2], [7, 3], [7, 4, 4]]
    t = pack_tree(seqs)
    n = t.num_tokens
    # In pre-order a node's parent is the nearest earlier node one level up, so each node's token
    # path follows from input_ids and position_ids alone; the nodes must be exactly the distinct
    # prefixes of the sequences.
    depth, ids = t.position_ids.tolist(), t.input_ids.tolist()
    path: list[tuple[int, ...]] = []
    for i in range(n):
        parent = next((j for j in range(i - 1, -1, -1) if depth[j] == depth[i] - 1), None) if depth[i] else None
        path.append((path[parent] if parent is not None else ()) + (ids[i],))
    assert sorted(path) == sorted({tuple(s[:d]) for s in seqs for d in range(1, len(s) + 1)})
    mask = torch.tensor([[path[i][: len(path[j])] == path[j] for j in range(n)] for i in range(n)])
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 4, n, 8), torch.randn(1, 4, n, 8), torch.randn(1, 4, n, 8)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2)
    out = _sdpa_per_tree(q, k, v, t.cu_trees, t.subtree_end, None)
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    block = create_block_mask(tree_mask_mod(t.subtree_end), None, None, n, n, device="cpu")
    flex = flex_attention(q, k, v, block_mask=block).transpose(1, 2)
    torch.testing.assert_close(flex, ref, rtol=1e-5, atol=1e-5)


def _load(path):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    use_packed_attention(model)
    return PackedPolicy(model)


def _forest(kind: str, rng: np.random.Generator, vocab: int) -> tuple[list[list[int]], list[int]]:
    """Sequences and their prompt lengths (loss positions: from prompt_len - 1 to the end - 1)."""
    tok = lambda n: rng.integers(3, vocab, n).tolist()  # noqa: E731
    if kind == "no_sharing":
        seqs = [[3 + i] + tok(int(rng.integers(1, 9))) for i in range(5)]  # distinct first tokens
        return seqs, [int(rng.integers(1, len(s) + 1)) for s in seqs]
    if kind == "partial":  # a preamble shared by all, two groups of three sharing their prompt
        pre = tok(5)
        seqs, plen = [], []
        for _ in range(2):
            prompt = pre + tok(int(rng.integers(1, 4)))
            for _ in range(3):
                seqs.append(prompt + tok(int(rng.integers(1, 6))))
                plen.append(len(prompt))
        return seqs, plen
    if kind == "full":  # one sequence four times
        s = tok(9)
        return [s] * 4, [4] * 4
    if kind == "prefix_of_another":
        s = tok(10)
        return [s, s[:6], s[:3] + tok(4), s[:1]], [2, 2, 2, 1]
    if kind == "empty_responses":  # prompt-only sequences (no loss position) beside ones with responses
        prompt = tok(6)
        return [prompt, prompt + tok(4), prompt, prompt + tok(1)], [6, 6, 6, 6]
    if kind == "one_token":
        return [[7], [7], [9], [7, 8]], [1, 1, 1, 1]
    raise AssertionError(kind)


KINDS = ["no_sharing", "partial", "full", "prefix_of_another", "empty_responses", "one_token"]


@pytest.mark.parametrize("path", ["sdpa", "varlen"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("fixture", ["tiny_model_dir", "tiny_qwen3_dir"])
def test_tree_logprobs_and_gradients_equal_unshared(kind, fixture, path, request):
    # varlen: the chain layout and the gathered key runs, the kernel stood in for by sdpa per run
    # (attention.bottom_right_varlen_reference), fp32 on CPU
    policy = _load(request.getfixturevalue(fixture))
    vocab = policy.lm.config.vocab_size
    seqs, plen = _forest(kind, np.random.default_rng(KINDS.index(kind)), vocab)
    starts = np.cumsum([0] + [len(s) for s in seqs])
    head = torch.tensor([int(starts[b]) + t for b, s in enumerate(seqs) for t in range(plen[b] - 1, len(s) - 1)],
                        dtype=torch.int64)
    flat = pack_sequences(seqs, head)
    tree = pack_tree(seqs, head, attention=path)
    assert (tree.chains is not None) == (path == "varlen")
    if kind in ("full", "partial", "prefix_of_another", "empty_responses"):
        assert tree.num_tokens < flat.num_tokens
    weight = torch.randn(flat.num_tokens, generator=torch.Generator().manual_seed(1))
    results = []
    for batch in (flat, tree):
        policy.zero_grad()
        logp, ent = packed_logprobs(policy, batch, temperature=0.7, chunk_tokens=5)
        (logp * weight).sum().backward()
        results.append((logp.detach(), ent, {n: p.grad.clone() for n, p in policy.named_parameters()}))
    (lp_f, ent_f, g_f), (lp_t, ent_t, g_t) = results
    assert lp_t.shape == lp_f.shape == (flat.num_tokens,)
    torch.testing.assert_close(lp_t, lp_f, rtol=0, atol=1e-5)
    torch.testing.assert_close(ent_t, ent_f, rtol=0, atol=1e-5)
    off = torch.ones(flat.num_tokens, dtype=torch.bool)
    off[head] = False
    assert (lp_t[off] == 0).all() and (ent_t[off] == 0).all()  # no log-prob outside the named rows
    for name, g in g_f.items():
        torch.testing.assert_close(g_t[name], g, rtol=1e-4, atol=1e-5, msg=name)


def test_tree_logprobs_by_hand_against_each_sequence_alone(tiny_model_dir):
    # The log-prob of sequence s at position t is log softmax(logits of s alone at t)[s[t+1]]:
    # a branch node's rows each get their own sequence's next token, and a leaf adds no row.
    # Sensitivity: the same forest read with the causal mask over the whole tree (every node
    # attending to every earlier node, siblings included) is off by > 1e-2.
    policy = _load(tiny_model_dir)
    reference = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32,
                                                     attn_implementation="sdpa").eval()
    seqs = [[5, 6, 7, 8], [5, 6, 9, 10], [5, 6, 7, 11]]
    tree = pack_tree(seqs)
    with torch.no_grad():
        lp, _ = packed_logprobs(policy, tree, 1.0)
        bounds = np.cumsum([0] + [len(s) for s in seqs])
        for b, s in enumerate(seqs):
            logits = reference(input_ids=torch.tensor([s])).logits[0]
            ref = torch.log_softmax(logits, -1)[:-1].gather(-1, torch.tensor(s[1:])[:, None])[:, 0]
            torch.testing.assert_close(lp[bounds[b] : bounds[b + 1] - 1], ref, rtol=0, atol=1e-5)
            assert lp[bounds[b + 1] - 1] == 0
        import dataclasses

        leaky = dataclasses.replace(tree, subtree_end=torch.full_like(tree.subtree_end, tree.num_tokens))
        lp_leaky, _ = packed_logprobs(policy, leaky, 1.0)
    assert (lp_leaky - lp).abs().max() > 1e-2


def test_cut_units_under_budgets_that_cut_a_tree():
    # One tree of 4 sequences sharing a 6-token prompt (unique tokens 6 + 4·4 = 22) and one lone
    # sequence. Budget 22 keeps the tree whole; 14 cuts it into 2 sub-trees of 6 + 2·4 = 14 each
    # (the prompt repeated), 10 into 4 of 6 + 4; a budget below one sequence leaves it alone.
    prompt = [1, 2, 3, 4, 5, 6]
    seqs = [prompt + [10 + i] * 4 for i in range(4)] + [[99, 98]]
    assert unique_tokens(seqs) == 24
    assert cut_units(seqs, 22) == [([0, 1, 2, 3], 22), ([4], 2)]
    assert cut_units(seqs, 14) == [([0, 1], 14), ([2, 3], 14), ([4], 2)]
    assert cut_units(seqs, 10) == [([0], 10), ([1], 10), ([2], 10), ([3], 10), ([4], 2)]
    assert cut_units(seqs, 8)[:4] == [([0], 10), ([1], 10), ([2], 10), ([3], 10)]
    # As even as the fewest runs allow: 3 leaves of 4 after the prompt under 18 would be greedy
    # 6+4+4+4 = 18 then 6+4 = 10; the bisected cap gives 14/14.
    assert [c for _, c in cut_units(seqs[:4], 18)] == [14, 14]
    for budget in (8, 10, 14, 17, 22):
        units = cut_units(seqs, budget)
        assert sorted(i for u, _ in units for i in u) == list(range(5))
        for members, cost in units:
            assert cost == unique_tokens([seqs[i] for i in members])
            assert cost <= budget or len(members) == 1


def test_tree_with_batch_invariant_linears(tiny_model_dir):
    # deterministic mode: tiled linears and the checkpointed LM head (not the fused one); the
    # forest gives the unshared log-probs and gradients, and the same forest twice the same bits
    from areal_async.batch_invariant import make_linears_batch_invariant
    from areal_async.trainer.packed_policy import _fusable

    policy = _load(tiny_model_dir)
    make_linears_batch_invariant(policy.lm)
    assert not _fusable(policy.lm.lm_head)
    seqs, plen = _forest("partial", np.random.default_rng(7), policy.lm.config.vocab_size)
    starts = np.cumsum([0] + [len(s) for s in seqs])
    head = torch.tensor([int(starts[b]) + t for b, s in enumerate(seqs) for t in range(plen[b] - 1, len(s) - 1)])
    out = []
    for batch in (pack_sequences(seqs, head), pack_tree(seqs, head), pack_tree(seqs, head)):
        policy.zero_grad()
        logp, _ = packed_logprobs(policy, batch, 1.0, chunk_tokens=4)
        logp.sum().backward()
        out.append((logp.detach(), policy.lm.model.embed_tokens.weight.grad.clone()))
    torch.testing.assert_close(out[1][0], out[0][0], rtol=0, atol=1e-5)
    torch.testing.assert_close(out[1][1], out[0][1], rtol=1e-4, atol=1e-5)
    assert torch.equal(out[1][0], out[2][0]) and torch.equal(out[1][1], out[2][1])


def _runs(tree) -> list[tuple[list[int], list[int]]]:
    """Per chain: (its query nodes, its key run's nodes)."""
    c = tree.chains
    cu_q, cu_k, idx = c.cu_q.tolist(), c.cu_k.tolist(), c.key_index.tolist()
    return [(list(range(cu_q[s], cu_q[s + 1])), idx[cu_k[s] : cu_k[s + 1]]) for s in range(len(cu_q) - 1)]


def test_chain_layout_by_hand():
    # sorted: [5,6] (a prefix of the next), [5,6,7,8], [5,6,7,8] again (an empty-response copy),
    # [5,6,9] (branches after 6), [4] (a one-token tree, sorted first). Nodes in pre-order:
    # 0:4 | 1:5 2:6 3:7 4:8 5:9. Node 2 (token 6) has two children (3 and 5): chains [0], [1,2],
    # [3,4], [5]; the prefix [5,6] continues its chain, the duplicate adds nothing.
    seqs = [[5, 6, 7, 8], [5, 6], [4], [5, 6, 9], [5, 6, 7, 8]]
    tree = pack_tree(seqs, attention="varlen")
    assert tree.input_ids.tolist() == [4, 5, 6, 7, 8, 9]
    assert _runs(tree) == [([0], [0]), ([1, 2], [1, 2]), ([3, 4], [1, 2, 3, 4]), ([5], [1, 2, 5])]
    assert (tree.chains.max_q, tree.chains.max_k) == (2, 4)
    assert tree.chains.cu_q.dtype == tree.chains.cu_k.dtype == torch.int32
    # bottom-right causal over each run is exactly the ancestor-or-self mask
    n = tree.num_tokens
    mask = torch.zeros(n, n, dtype=torch.bool)
    for q, k in _runs(tree):
        for i, node in enumerate(q):
            mask[node, k[: len(k) - len(q) + i + 1]] = True
    idx = torch.arange(n)
    want = (idx[None, :] <= idx[:, None]) & (idx[:, None] < tree.subtree_end[None, :])
    assert torch.equal(mask, want)


def test_chain_layout_of_a_cut_tree():
    # one prompt [1,2,3] with four responses, cut under a budget of 7 unique tokens into runs of
    # the sorted sequences; each run is a tree of its own that repeats the prompt
    seqs = [[1, 2, 3, 10, 11], [1, 2, 3, 12, 13], [1, 2, 3, 14], [1, 2, 3, 15, 16]]
    units = cut_units(seqs, 7)
    assert [u for u, _ in units] == [[0, 1], [2, 3]]
    first = pack_tree([seqs[i] for i in units[0][0]], attention="varlen")
    assert first.input_ids.tolist() == [1, 2, 3, 10, 11, 12, 13]
    assert _runs(first) == [([0, 1, 2], [0, 1, 2]), ([3, 4], [0, 1, 2, 3, 4]), ([5, 6], [0, 1, 2, 5, 6])]
    second = pack_tree([seqs[i] for i in units[1][0]], attention="varlen")
    assert second.input_ids.tolist() == [1, 2, 3, 14, 15, 16]
    assert _runs(second) == [([0, 1, 2], [0, 1, 2]), ([3], [0, 1, 2, 3]), ([4, 5], [0, 1, 2, 4, 5])]


def test_chain_layout_rejects_a_parent_list_out_of_pre_order():
    with pytest.raises(ValueError, match="pre-order"):
        chain_layout(np.array([-1, 0, 0, 1]))  # node 3's parent 1 is not its predecessor (2)
    with pytest.raises(ValueError, match="pre-order"):
        chain_layout(np.array([0, -1]))
    with pytest.raises(ValueError, match="not a tree attention path"):
        pack_tree([[1, 2]], attention="dense")
