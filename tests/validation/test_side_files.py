"""The cached affinity table (a side file in <ckpt>/.specmoe): corrupt, truncated, stale, of the
wrong shape, non-finite, or a pickle (even a malicious one) is recomputed and rewritten, never
unpickled, and no message suggests unsafe loading. Files outside .specmoe never change."""
import json
import os
import pickle

import pytest
import torch
from safetensors.torch import save_file

from specmoe import LLM, SamplingParams
from specmoe.decoding.drafters import affinity as A
from specmoe.weights.checkpoint import Checkpoint
from tests.validation.conftest import snapshot


class Evil:
    """Unpickling this creates a marker file: proof that a pickle was executed."""
    marker = None

    def __reduce__(self):
        return (open, (str(Evil.marker), "w"))


def corrupt_cases(ck, path, tmp_path):
    E = ck.config.num_experts
    layers = list(ck.config.moe_layers)
    good_meta = {"format": A.FORMAT, "fingerprint": ck.fingerprint(), "layers": json.dumps(layers)}

    def tables(fn):
        return {f"layer.{l}": fn() for l in layers}
    return {
        "garbage": lambda: path.write_bytes(b"\x00\x01not a table at all"),
        "empty": lambda: path.write_bytes(b""),
        "truncated": lambda: path.write_bytes(path.read_bytes()[:-40]),
        "pickle": lambda: torch.save({"format": 1, "fingerprint": ck.fingerprint(), "tables": []}, path),
        "malicious_pickle": lambda: path.write_bytes(pickle.dumps({"x": Evil()})),
        "stale_fingerprint": lambda: save_file(tables(lambda: torch.zeros(E, E)), path,
                                               metadata={**good_meta, "fingerprint": "other"}),
        "wrong_shape": lambda: save_file(tables(lambda: torch.zeros(E, E - 1)), path, metadata=good_meta),
        "nan_table": lambda: save_file(tables(lambda: torch.full((E, E), float("nan"))), path, metadata=good_meta),
        "negative_table": lambda: save_file(tables(lambda: -torch.ones(E, E)), path, metadata=good_meta),
        "wrong_dtype": lambda: save_file(tables(lambda: torch.zeros(E, E, dtype=torch.int32)), path,
                                         metadata=good_meta),
        "missing_layer": lambda: save_file({f"layer.{layers[0]}": torch.zeros(E, E)}, path, metadata=good_meta),
        "no_metadata": lambda: save_file(tables(lambda: torch.zeros(E, E)), path),
    }


CASES = ["garbage", "empty", "truncated", "pickle", "malicious_pickle", "stale_fingerprint", "wrong_shape",
         "nan_table", "negative_table", "wrong_dtype", "missing_layer", "no_metadata"]


@pytest.mark.parametrize("case", CASES)
def test_corrupt_affinity_is_recomputed(ckpt, tmp_path, monkeypatch, capsys, recwarn, case):
    ck = Checkpoint(ckpt)
    truth = A.compute_affinity(ck)
    A.load_or_compute_affinity(ck)  # writes the cache
    path = A.cache_paths(ck)[0]
    assert path.is_file() and path.parent.name == ".specmoe"
    Evil.marker = tmp_path / "pwned"
    corrupt_cases(ck, path, tmp_path)[case]()
    before = snapshot(ckpt)

    def no_unpickling(*a, **k):
        raise AssertionError("a side file was unpickled")
    monkeypatch.setattr(torch, "load", no_unpickling)
    monkeypatch.setattr(pickle, "load", no_unpickling)
    monkeypatch.setattr(pickle, "loads", no_unpickling)
    table = A.load_or_compute_affinity(ck)
    assert set(table) == set(truth) and all(torch.equal(table[k], truth[k]) for k in truth)
    assert not Evil.marker.exists()
    # the bad file was replaced by a good one: a second load reads it without recomputing
    monkeypatch.setattr(A, "compute_affinity", lambda ck: pytest.fail("recomputed a valid cache"))
    again = A.load_or_compute_affinity(ck)
    assert all(torch.equal(again[k], truth[k]) for k in truth)
    out = capsys.readouterr()
    text = out.out + out.err + " ".join(str(w.message) for w in recwarn)
    assert "weights_only" not in text and "unsafe" not in text.lower()
    assert snapshot(ckpt) == before  # only .specmoe changed
    assert not [p for p in path.parent.iterdir() if p.name.endswith(".tmp")]


def test_old_pickle_cache_is_never_read(ckpt, tmp_path):
    """A leftover affinity.pt from the pickle format, even a malicious one, is ignored."""
    (ckpt / ".specmoe").mkdir()
    Evil.marker = tmp_path / "pwned"
    (ckpt / ".specmoe" / "affinity.pt").write_bytes(pickle.dumps(Evil()))
    llm = LLM(ckpt, dtype="float32", decoding="specmoe", draft_experts=2, substitution="affinity")
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=6, ignore_eos=True))
    assert len(out[0].token_ids) == 6 and not Evil.marker.exists()
    assert (ckpt / ".specmoe" / "affinity.safetensors").is_file()
    assert os.path.getsize(ckpt / ".specmoe" / "affinity.safetensors") > 0
