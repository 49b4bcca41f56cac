"""The memory limit a process runs under (memory.py: cgroup v1 / v2 files under a fake root, MemAvailable), the expert
cache sized from it when the user sizes nothing (factory.plan_store, budget.limit_budget), and a limit too small for
the non-expert weights + the minimal cache refused before any weight is loaded."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import specmoe.engine.llm as llm_module
from specmoe import LLM, SamplingParams
from specmoe import memory
from specmoe.experts.budget import BudgetTooSmallError, MemoryLimitError, headroom, mib, non_expert_bytes
from specmoe.experts.factory import plan_store
from specmoe.memory import NO_LIMIT, MemoryLimit, cgroup_memory_limit, memory_limit
from specmoe.options import OffloadConfig
from specmoe.weights.checkpoint import Checkpoint

GiB, MiB = 2**30, 2**20
V1_SENTINEL = 9223372036854771712


def fake_root(tmp_path: Path, cgroup: str, files: dict[str, str], *, avail_kib: int = 64 * 2**20,
              rss_pages: int = 0) -> Path:
    """A file-system root with /proc/self/cgroup = `cgroup`, the given files under it, MemAvailable and statm."""
    (tmp_path / "proc/self").mkdir(parents=True)
    (tmp_path / "proc/self/cgroup").write_text(cgroup)
    (tmp_path / "proc/meminfo").write_text(f"MemTotal: {2 * avail_kib} kB\nMemAvailable: {avail_kib} kB\n")
    (tmp_path / "proc/self/statm").write_text(f"1000 {rss_pages} 0 0 0 0 0\n")
    for rel, text in files.items():
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return tmp_path


V1 = "12:pids:/\n4:memory:/bench/run1\n1:cpu:/\n0::/\n"
V2 = "0::/user.slice/job\n"


def test_v1_limit_is_read_from_the_process_cgroup(tmp_path):
    root = fake_root(tmp_path, V1, {"sys/fs/cgroup/memory/bench/run1/memory.limit_in_bytes": f"{2 * GiB}\n",
                                    "sys/fs/cgroup/memory/bench/memory.limit_in_bytes": f"{V1_SENTINEL}\n",
                                    "sys/fs/cgroup/memory/memory.limit_in_bytes": f"{V1_SENTINEL}\n"})
    assert cgroup_memory_limit(root) == ("v1", 2 * GiB, "/sys/fs/cgroup/memory/bench/run1/memory.limit_in_bytes")


def test_v1_sentinel_everywhere_is_no_limit(tmp_path):
    root = fake_root(tmp_path, V1, {"sys/fs/cgroup/memory/bench/run1/memory.limit_in_bytes": f"{V1_SENTINEL}\n",
                                    "sys/fs/cgroup/memory/memory.limit_in_bytes": f"{V1_SENTINEL}\n"})
    assert V1_SENTINEL >= NO_LIMIT and cgroup_memory_limit(root) is None
    lim = memory_limit(root)
    assert lim.cgroup is None and lim.bound_by == "MemAvailable" and lim.room == 64 * GiB


def test_a_tighter_ancestor_bounds_the_child(tmp_path):
    root = fake_root(tmp_path, V1, {"sys/fs/cgroup/memory/bench/run1/memory.limit_in_bytes": f"{8 * GiB}\n",
                                    "sys/fs/cgroup/memory/bench/memory.limit_in_bytes": f"{3 * GiB}\n"})
    assert cgroup_memory_limit(root) == ("v1", 3 * GiB, "/sys/fs/cgroup/memory/bench/memory.limit_in_bytes")


def test_inside_a_cgroup_namespace_the_mounts_own_file_is_the_limit(tmp_path):
    root = fake_root(tmp_path, V1, {"sys/fs/cgroup/memory/memory.limit_in_bytes": f"{GiB}\n"})
    assert cgroup_memory_limit(root) == ("v1", GiB, "/sys/fs/cgroup/memory/memory.limit_in_bytes")


@pytest.mark.parametrize("text,want", [("max\n", None), (f"{5 * GiB}\n", 5 * GiB)])
def test_v2_memory_max(tmp_path, text, want):
    root = fake_root(tmp_path, V2, {"sys/fs/cgroup/user.slice/job/memory.max": text,
                                    "sys/fs/cgroup/user.slice/memory.max": "max\n"})
    got = cgroup_memory_limit(root)
    assert got == (None if want is None else ("v2", want, "/sys/fs/cgroup/user.slice/job/memory.max"))


def test_no_proc_or_no_controller_is_no_limit(tmp_path):
    assert cgroup_memory_limit(tmp_path) is None
    assert cgroup_memory_limit(fake_root(tmp_path, V1, {})) is None  # the v1 memory hierarchy is not mounted


def test_room_is_the_smaller_of_the_cgroup_left_and_mem_available(tmp_path):
    page = __import__("os").sysconf("SC_PAGE_SIZE")
    root = fake_root(tmp_path, V1, {"sys/fs/cgroup/memory/bench/run1/memory.limit_in_bytes": f"{2 * GiB}\n"},
                     avail_kib=16 * 2**20, rss_pages=(256 * MiB) // page)
    lim = memory_limit(root)
    assert (lim.cgroup, lim.cgroup_bytes, lim.used_bytes) == ("v1", 2 * GiB, 256 * MiB)
    assert lim.room == 2 * GiB - 256 * MiB and lim.bound_by == "cgroup v1"
    tight = fake_root(tmp_path / "t", V1, {"sys/fs/cgroup/memory/bench/run1/memory.limit_in_bytes": f"{2 * GiB}\n"},
                      avail_kib=2**20)
    assert memory_limit(tight).room == GiB and memory_limit(tight).bound_by == "MemAvailable"


# ---------------------------------------------------------------- sizing and refusal (tiny checkpoint)

def limit(room: int) -> MemoryLimit:
    return MemoryLimit(cgroup="v1", cgroup_bytes=room, cgroup_file="/fake/memory.limit_in_bytes",
                       available_bytes=64 * GiB)


def plan(path, room: int | None, **opts):
    ckpt = Checkpoint(path)
    lim = MemoryLimit(None, None, None, 64 * GiB) if room is None else limit(room)
    return plan_store(ckpt, OffloadConfig(**opts), dtype=torch.float32, device=torch.device("cpu"), limit=lim)


@pytest.fixture
def sizes(tiny_ckpt):
    """(checkpoint, non-expert bytes, bytes of one more slot per layer, the default plan's slots and total)."""
    path = tiny_ckpt("qwen3_moe", num_experts=16)  # default slots E/4 = 4 above top-k (2): room to size down
    free = plan(path, None, offload="disk")
    a, b = plan(path, None, offload="disk", cache_experts=3), plan(path, None, offload="disk", cache_experts=4)
    return path, free.limit.non_expert_bytes, b.memory.total - a.memory.total, free.memory


def test_nothing_limiting_keeps_the_default_slots(sizes):
    path, non_expert, per_slot, default = sizes
    assert default.slots == 4  # E/4, at least top-k
    room = non_expert + default.total + headroom(10 * GiB) + 10 * GiB  # a limit above what the default needs
    p = plan(path, room, offload="disk")
    assert p.memory.slots == default.slots and p.memory.parts == default.parts
    assert p.limit.sized_by == "default" and p.limit.budget == room - non_expert - headroom(room)


def test_a_limit_below_the_default_needs_sizes_the_cache_from_what_it_leaves(sizes):
    path, non_expert, per_slot, default = sizes
    mc = Checkpoint(path).config
    # room for exactly top-k slots (+ the fixed parts) after the non-expert weights and the headroom
    fixed = default.total - default.slots * per_slot
    room = HEAD + non_expert + fixed + mc.top_k * per_slot
    assert headroom(room) == HEAD
    p = plan(path, room, offload="disk")
    assert p.memory.slots == mc.top_k < default.slots
    assert p.memory.total <= p.limit.budget == room - non_expert - HEAD
    assert p.limit.sized_by == "memory limit" and p.memory.memory_budget is None


HEAD = headroom(0)  # the fixed minimum under small limits


def test_through_the_api_a_cgroup_limit_sizes_the_cache_and_stats_say_so(sizes, tmp_path, monkeypatch):
    path, non_expert, per_slot, default = sizes
    mc = Checkpoint(path).config
    room = HEAD + non_expert + (default.total - default.slots * per_slot) + mc.top_k * per_slot
    root = fake_root(tmp_path, V1, {"sys/fs/cgroup/memory/bench/run1/memory.limit_in_bytes": f"{room}\n"})
    monkeypatch.setattr(memory, "FS_ROOT", root)
    llm = LLM(path, offload="disk", repack_dir=str(tmp_path / "rp"))
    s = llm.stats
    assert s["cache_slots_per_layer"] == mc.top_k
    lim = s["memory_limit"]
    assert lim["cgroup"] == "v1" and lim["cgroup_limit_bytes"] == room and lim["bound_by"] == "cgroup v1"
    assert lim["cache_sized_by"] == "memory limit" and lim["limit_expert_budget"] == room - non_expert - HEAD
    assert lim["cgroup_file"] == "/sys/fs/cgroup/memory/bench/run1/memory.limit_in_bytes"
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert len(out[0].token_ids) == 4 and llm.stats["misses"] > 0


def test_user_sizes_stand_under_a_limit_that_holds_the_minimum(sizes):
    path, non_expert, per_slot, default = sizes
    room = HEAD + non_expert + default.total  # the default fits; 12 slots would not
    p = plan(path, room, offload="disk", cache_experts=12)
    assert p.memory.slots == 12 and p.limit.sized_by == "cache_experts" and p.limit.budget is None


def test_a_limit_too_small_for_the_weights_and_the_minimal_cache_is_refused_with_the_numbers(sizes):
    path, non_expert, per_slot, default = sizes
    minimal = default.total - (default.slots - 2) * per_slot
    room = HEAD + non_expert + minimal - 1
    with pytest.raises(MemoryLimitError) as e:
        plan(path, room, offload="disk")
    msg = str(e.value)
    assert "\n" not in msg and "memory limit too small" in msg and "cgroup v1 limit" in msg
    assert f"non-expert weights {mib(non_expert)}" in msg and f"minimal expert cache {mib(minimal)}" in msg
    assert "2 slots per layer" in msg
    plan(path, room + 1, offload="disk")  # one byte more holds it
    with pytest.raises(MemoryLimitError):  # the user's sizes do not escape it
        plan(path, room, offload="disk", cache_experts=2)


def test_the_host_tier_counts_every_expert_against_the_limit(sizes):
    path, non_expert, per_slot, default = sizes
    room = HEAD + non_expert + default.total  # enough for the disk tier's default cache, not for all experts in RAM
    plan(path, room, offload="disk")
    with pytest.raises(MemoryLimitError, match="offload='disk' .the host tier holds every expert"):
        plan(path, room, offload="host")


def test_non_expert_estimate_bounds_the_measured_weights():
    llm = LLM()  # the demo model: fp32 compute over bf16-stored projections and a stored head copy
    got = llm.stats["memory"]["non_expert_weights"]
    from specmoe.models.loader import stored_dtype
    bound = non_expert_bytes(llm.config, llm.dtype, stored_dtype(llm.ckpt.storage_dtype, llm.dtype, llm.device))
    assert got <= bound <= 1.3 * got


# ---------------------------------------------------------------- refused before loading (public API)

@pytest.fixture
def no_loading(monkeypatch):
    """LLM(...)'s load_model replaced by one that records a call (and then loads as usual)."""
    calls = []
    real = llm_module.load_model

    def spy(*a, **k):
        calls.append(a)
        return real(*a, **k)
    monkeypatch.setattr(llm_module, "load_model", spy)
    return calls


def test_a_cgroup_limit_too_small_is_refused_before_any_weight_is_loaded(sizes, tmp_path, monkeypatch, no_loading):
    path, non_expert, per_slot, default = sizes
    root = fake_root(tmp_path, V1, {"sys/fs/cgroup/memory/bench/run1/memory.limit_in_bytes": f"{HEAD}\n"})
    monkeypatch.setattr(memory, "FS_ROOT", root)
    rp = tmp_path / "repack"
    with pytest.raises(MemoryLimitError, match=r"memory limit too small: cgroup v1 limit .*bench/run1"):
        LLM(path, offload="disk", repack_dir=str(rp))
    assert no_loading == [] and not rp.exists()  # no weights loaded, no repack written
    monkeypatch.setattr(memory, "FS_ROOT", fake_root(tmp_path / "big", V1, {}))
    LLM(path, offload="disk", repack_dir=str(rp))
    assert len(no_loading) == 1  # the spy does see a load


def test_an_explicit_memory_budget_too_small_is_refused_before_any_weight_is_loaded(sizes, tmp_path, no_loading):
    path = sizes[0]
    with pytest.raises(BudgetTooSmallError, match="memory_budget=.* is too small"):
        LLM(path, offload="disk", memory_budget=1000, repack_dir=str(tmp_path / "rp"))
    assert no_loading == [] and not (tmp_path / "rp").exists()
