"""Weight-major projections (`specmoe.models.orientation`): the same products as F.linear, taken where the probe
says so and only there, in the dense layers, the routed experts and a whole model's decoding."""
import statistics

import pytest
import torch
import torch.nn.functional as F

from specmoe.models import layers, moe, orientation



@pytest.fixture
def forced(monkeypatch):
    """Weight-major for every fp32 weight on this thread count (as if the probe had found it faster from 1
    element); the calls to `weight_major` and to the weight-major grouped product are counted."""
    calls = {"dense": 0, "grouped": 0}
    monkeypatch.setitem(orientation._WINS, (torch.float32, torch.get_num_threads()), (1, 64))
    real = layers.weight_major

    def counted(*a, **k):
        calls["dense"] += 1
        return real(*a, **k)
    monkeypatch.setattr(layers, "weight_major", counted)
    real_gmm = moe.F.grouped_mm

    class _F:  # moe's F with grouped_mm counted when its first operand is the 3-D weight
        def __getattr__(self, name):
            return getattr(F, name)

        @staticmethod
        def grouped_mm(a, b, **k):
            calls["grouped"] += a.dim() == 3
            return real_gmm(a, b, **k)
    monkeypatch.setattr(moe, "F", _F())
    return calls


def test_weight_major_is_the_same_product():
    g = torch.Generator().manual_seed(0)
    for n, out, inn in ((2, 64, 32), (5, 300, 256), (17, 8, 1024)):
        x, w, b = torch.randn(n, inn, generator=g), torch.randn(out, inn, generator=g), torch.randn(out, generator=g)
        y = orientation.weight_major(x, w, b)
        assert y.is_contiguous() and y.shape == (n, out)
        torch.testing.assert_close(y, F.linear(x, w, b), rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(orientation.weight_major(x, w), F.linear(x, w), rtol=1e-5, atol=1e-4)


def test_dense_layers_take_it_only_where_told(forced):
    g = torch.Generator().manual_seed(1)
    x, w, b = torch.randn(2, 3, 64, generator=g), torch.randn(48, 64, generator=g), torch.randn(48, generator=g)
    torch.testing.assert_close(layers.linear(x, w, b), F.linear(x, w, b), rtol=1e-5, atol=1e-4)
    assert forced["dense"] == 1
    acc = torch.randn(6, 48, generator=g)
    torch.testing.assert_close(layers.addmm(acc, x.view(6, 64), w.t()), torch.addmm(acc, x.view(6, 64), w.t()),
                               rtol=1e-5, atol=1e-4)
    assert forced["dense"] == 1  # addmm's weight-major form is its own addmm
    layers.linear(x[:1, :1], w)  # one row: F.linear
    layers.linear(x, w, rows=4)  # a deterministic model: padded F.linear (its row classes)
    layers.linear(x.to(torch.float64), w.to(torch.float64))  # no threshold known for this dtype
    assert forced["dense"] == 1
    orientation._WINS.pop((torch.float32, torch.get_num_threads()))
    layers.linear(x, w)
    assert forced["dense"] == 1


@pytest.mark.parametrize("bias", [False, True])
def test_routed_experts_weight_major_equal(forced, bias):
    g = torch.Generator().manual_seed(2)
    S, D, I, n = 4, 32, 48, 7
    gate_up, down = torch.randn(S, 2 * I, D, generator=g), torch.randn(S, D, I, generator=g)
    group = moe.SlotGroup(gate_up, down, slot_of=torch.arange(S + 1))
    if bias:
        group.gate_up_bias, group.down_bias = torch.randn(S, 2 * I, generator=g), torch.randn(S, D, generator=g)
    slot = torch.tensor([0, 0, 1, 3, 3, 3, S])  # sorted; the last row is another group's
    offs = torch.searchsorted(slot, torch.arange(S), right=True, out_int32=True)
    x = torch.randn(n, D, generator=g)
    ref = moe.swiglu_grouped(x, group, offs, slot if bias else None, moe.ExpertMath(), n=6)
    assert forced["grouped"] == 0
    got = moe.swiglu_grouped(x, group, offs, slot if bias else None, moe.ExpertMath(), n=6, weight_major=True)
    assert forced["grouped"] == 2  # both projections
    torch.testing.assert_close(got[:6], ref[:6], rtol=1e-5, atol=1e-4)


def test_model_decodes_the_same_weight_major(forced, torch_path):
    from specmoe import LLM, SamplingParams
    llm = LLM(dtype="float32", max_batch=3)
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9], [10, 11, 12, 13]]
    got = [o.token_ids for o in llm.generate(prompts, sp)]
    assert forced["dense"] > 0 and forced["grouped"] > 0
    orientation._WINS.pop((torch.float32, torch.get_num_threads()))
    n = dict(forced)
    ref = [o.token_ids for o in llm.generate(prompts, sp)]
    assert forced == n  # the reference never took it
    assert got == ref


def test_probe_and_prepare():
    """The real probe: its threshold and max rows are the ones the rule gives on the ratios it measured (the
    decision itself is checked on ratios set by hand below)."""
    r = orientation.probe(sizes=(32, 64), rows=(2, 4), more_rows=(8,), rounds=1)
    ratio = r["ratio"]
    assert all({"2", "4"} <= set(ratio[n]) for n in ("32", "64"))
    wins = [statistics.median(ratio[n][m] for m in ("2", "4")) <= orientation.WIN
            and max(ratio[n][m] for m in ("2", "4")) <= orientation.NEVER_WORSE for n in ("32", "64")]
    assert r["min_numel"] == (32 * 32 if all(wins) else 64 * 64 if wins[1] else None), r
    if r["min_numel"] is None:
        assert set(ratio) == {"32", "64"} and r["max_rows"] is None
    else:
        wide = f"{orientation.WIDE[0]}x{orientation.WIDE[1]}"
        kept = [k for k in ("32", "64") if int(k) ** 2 >= r["min_numel"]] + [wide]
        assert set(ratio) == {"32", "64", wide}
        assert r["max_rows"] == (8 if max(ratio[k]["8"] for k in kept) <= orientation.WIN else 4), r
    assert orientation.prepare(torch.float32, "meta") is None
    key = (torch.float32, torch.get_num_threads())
    assert orientation.prepare(torch.float32, "cpu") == orientation._WINS[key]


def fake_ratios(monkeypatch, table):
    """`orientation._ratio` replaced by `table[(size, rows)]` (size: the weight's first dimension), so the probe's
    decision is checked on ratios set by hand."""
    seen = []

    def ratio(w, m, g, rounds):
        seen.append((w.shape[0], m))
        return table(w.shape[0], m)
    monkeypatch.setattr(orientation, "_ratio", ratio)
    return seen


def test_probe_takes_the_smallest_size_from_which_every_larger_one_wins(monkeypatch):
    """Sizes 16 and 64 win, 32 does not: the threshold is 64² (from 64 on, every size wins), not 16² (the first
    size that wins)."""
    loses = {32}
    fake_ratios(monkeypatch, lambda n, m: 1.5 if n in loses else 0.5)
    r = orientation.probe(sizes=(16, 32, 64, 128), rows=(2, 4), more_rows=(8,), rounds=1)
    assert r["min_numel"] == 64 * 64 and r["max_rows"] == 8
    loses.add(128)  # the largest size loses: no size wins at it and every larger one
    assert orientation.probe(sizes=(16, 32, 64, 128), rows=(2, 4), more_rows=(8,), rounds=1)["min_numel"] is None
    loses.clear()
    assert orientation.probe(sizes=(16, 32, 64, 128), rows=(2, 4), more_rows=(8,), rounds=1)["min_numel"] == 16 * 16


def test_probe_win_needs_the_median_and_every_row_count(monkeypatch):
    """A size wins when its median ratio over the rows is at most WIN and none is above NEVER_WORSE; past the
    rows probed, max_rows grows while every size from the threshold on (and the wide shape) stays within WIN."""
    fake_ratios(monkeypatch, lambda n, m: {2: 0.5, 4: 0.5, 8: 1.2}[m] if n == 16 else 0.5 if m <= 64 else 0.95)
    r = orientation.probe(sizes=(16, 32), rows=(2, 4, 8), more_rows=(64, 128), rounds=1)
    assert r["min_numel"] == 32 * 32 and r["max_rows"] == 64  # 16: median 0.5 but 8 rows at 1.2
    assert set(r["ratio"]) == {"16", "32", f"{orientation.WIDE[0]}x{orientation.WIDE[1]}"}
    fake_ratios(monkeypatch, lambda n, m: {2: 0.5, 4: 0.95, 8: 0.95}[m])  # median 0.95 > WIN: never wins
    assert orientation.probe(sizes=(16, 32), rows=(2, 4, 8), more_rows=(64,), rounds=1)["max_rows"] is None


def test_weight_major_only_from_the_threshold_and_up_to_its_rows(monkeypatch):
    """`use_weight_major` takes the probe's (min numel, max rows): weights below the threshold and more rows than
    max rows keep F.linear."""
    monkeypatch.setitem(orientation._WINS, (torch.float32, torch.get_num_threads()), (1000, 8))
    x = torch.zeros(4, 16)
    assert orientation.use_weight_major(x, 1000) and orientation.use_weight_major(x, 5000)
    assert not orientation.use_weight_major(x, 999)
    assert orientation.use_weight_major(torch.zeros(8, 16), 1000)
    assert not orientation.use_weight_major(torch.zeros(9, 16), 1000)
    assert not orientation.use_weight_major(x.double(), 5000)  # no threshold known for fp64


def test_dense_layers_keep_f_linear_below_the_threshold(forced, monkeypatch):
    """Through `layers.linear`: with the threshold between two weights' sizes, only the larger takes the
    weight-major product."""
    monkeypatch.setitem(orientation._WINS, (torch.float32, torch.get_num_threads()), (48 * 64, 64))
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 64, generator=g)
    small, big = torch.randn(47, 64, generator=g), torch.randn(48, 64, generator=g)
    torch.testing.assert_close(layers.linear(x, small), F.linear(x, small), rtol=1e-5, atol=1e-4)
    assert forced["dense"] == 0
    torch.testing.assert_close(layers.linear(x, big), F.linear(x, big), rtol=1e-5, atol=1e-4)
    assert forced["dense"] == 1
