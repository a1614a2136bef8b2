"""Every GGUF tensor type: the ones the gguf package reads load (against its own reference and, where
transformers has a kernel, against that); every other type fails with an error naming it."""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from batchgen.engine.loading.gguf.loader import dequantize_tensor

FLOATS = {Q.F32: np.float32, Q.F16: np.float16, Q.F64: np.float64}
INTEGERS = (Q.I8, Q.I16, Q.I32, Q.I64)


def package_can(operation: str, qtype: Q) -> bool:
    """Whether the gguf package can ``operation`` ("quantize" or "dequantize") tensors of the type."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    data = np.zeros((1, size), dtype=np.uint8) if operation == "dequantize" else np.zeros((1, block), np.float32)
    try:
        getattr(gguf.quants, operation)(data, qtype)
    except NotImplementedError:
        return False
    return True


def raw_tensor(qtype: Q, rows: int = 3, blocks: int = 2, seed: int = 0) -> np.ndarray:
    """Random bytes of ``rows`` x ``blocks`` blocks of the type; plain floats for the float types."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed + int(qtype))
    if qtype in FLOATS:
        return rng.standard_normal((rows, blocks * block)).astype(FLOATS[qtype])
    raw = rng.integers(0, 256, size=(rows, blocks * size), dtype=np.uint8)
    raw[:, 1::2] &= 0x3B  # keeps any fp16 scale finite and modest, wherever the format puts it
    return raw


def written(path: Path, array: np.ndarray, qtype: Q, name: str = "blk.0.ffn_down.weight"):
    """The tensor as our loader reads it back from a GGUF file."""
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tensor(name, array, raw_dtype=None if qtype in FLOATS else qtype)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    return gguf.GGUFReader(str(path)).tensors[0]


@pytest.mark.parametrize("qtype", list(Q), ids=lambda q: q.name)
def test_every_type_loads_as_the_package_reads_it_or_is_named(tmp_path, qtype):
    raw = raw_tensor(qtype)
    tensor = written(tmp_path / "t.gguf", raw, qtype)
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    if qtype in INTEGERS:
        with pytest.raises(ValueError, match=rf"ffn_down\.weight.*integer type {qtype.name}"):
            dequantize_tensor(tensor)
    elif qtype == Q.F64 or package_can("dequantize", qtype):
        ours = dequantize_tensor(tensor)
        assert ours.dtype == torch.float32 and ours.shape == (3, 2 * block)
        reference = raw if qtype in FLOATS else gguf.quants.dequantize(raw, qtype)
        expected = torch.from_numpy(np.asarray(reference, dtype=np.float32).reshape(3, 2 * block))
        torch.testing.assert_close(ours, expected, rtol=0, atol=0, equal_nan=True)
    else:
        with pytest.raises(ValueError, match=rf"ffn_down\.weight.*type {qtype.name}.*cannot dequantize"):
            dequantize_tensor(tensor)


QUANTIZABLE = [q for q in Q if q not in FLOATS and q not in INTEGERS and package_can("quantize", q)]


@pytest.mark.parametrize("qtype", QUANTIZABLE, ids=lambda q: q.name)
def test_quantized_by_the_package_round_trips(tmp_path, qtype):
    """Values the package quantizes come back as it dequantizes them, and near the originals."""
    rng = np.random.default_rng(int(qtype))
    values = rng.standard_normal((4, 2 * gguf.GGML_QUANT_SIZES[qtype][0])).astype(np.float32)
    packed = gguf.quants.quantize(values, qtype)
    ours = dequantize_tensor(written(tmp_path / "q.gguf", packed, qtype))
    expected = torch.from_numpy(gguf.quants.dequantize(packed, qtype))
    assert ours.shape == values.shape
    torch.testing.assert_close(ours, expected, rtol=0, atol=0)
    error = (ours - torch.from_numpy(values)).abs().max().item()
    assert error <= 0.5 * np.abs(values).max()  # ternary types are coarse; the rest far closer


@pytest.mark.parametrize("qtype", [Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_NL, Q.Q8_0], ids=lambda q: q.name)
def test_dequantize_matches_transformers_kernels(tmp_path, qtype):
    """Random blocks (gguf can't quantize K-quants) decoded by us and by transformers' own torch code."""
    from transformers.integrations.gguf.dequant import dequantize as hf_dequantize

    block = gguf.GGML_QUANT_SIZES[qtype][0]
    raw = raw_tensor(qtype)
    ours = dequantize_tensor(written(tmp_path / "q.gguf", raw, qtype))
    assert ours.shape == (3, 2 * block) and ours.dtype == torch.float32
    ref = hf_dequantize(torch.from_numpy(raw.copy()), int(qtype)).reshape(3, 2 * block)
    assert torch.isfinite(ref).all()
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-6)
