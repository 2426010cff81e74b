"""Safetensors files read tensor by tensor and row range by row range, in the stored dtype.

A HF checkpoint directory holds `model.safetensors` or shards listed in `model.safetensors.index.json`. Each
file is an 8-byte header length, a JSON header (name -> dtype, shape, byte offsets) and the raw row-major
data. `SafetensorsDir` parses only the headers; `read(name, rows)` then reads the bytes of rows [r0, r1) of
one tensor with one positioned read (`np.fromfile(offset=...)`) into a fresh array: no memory map stays
open, so host memory holds exactly what was asked for (a mapped file's touched pages would count as the
process's resident memory until it is closed), and bf16 comes back as `ml_dtypes.bfloat16` (numpy has no
bfloat16; `safetensors`' own numpy loader needs a recent release for it).

`write_safetensors` streams tensors to a file one at a time (the benchmark writes a 15 GB checkpoint with it
without holding it in memory).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from collections.abc import Callable, Iterable

import ml_dtypes
import numpy as np

from tlt_jax.models.gguf import PathLike, missing_path_error

SAFETENSORS_DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
}
_DTYPE_NAMES = {v: k for k, v in SAFETENSORS_DTYPES.items()}
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives: its file, dtype, shape and the absolute byte offset of its first element."""

    file: pathlib.Path
    dtype: np.dtype
    shape: tuple[int, ...]
    offset: int

    @property
    def row_elems(self) -> int:
        """Elements per row (the product of every dim but the first; 1 for a vector)."""
        return int(np.prod(self.shape[1:], dtype=np.int64))


def read_header(file: pathlib.Path) -> dict[str, TensorInfo]:
    """The tensors of one .safetensors file (name -> TensorInfo), from its header only."""
    with open(file, "rb") as fh:
        header_len = int.from_bytes(fh.read(8), "little")
        header = json.loads(fh.read(header_len))
    out: dict[str, TensorInfo] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        kind = info["dtype"]
        if kind not in SAFETENSORS_DTYPES:
            supported = ", ".join(SAFETENSORS_DTYPES)
            raise ValueError(f"{file}: tensor {name!r} has dtype {kind}; supported: {supported}.")
        start, end = info["data_offsets"]
        shape = tuple(int(s) for s in info["shape"])
        dtype = SAFETENSORS_DTYPES[kind]
        if end - start != int(np.prod(shape, dtype=np.int64)) * dtype.itemsize:
            raise ValueError(f"{file}: tensor {name!r}: byte range {start}..{end} does not match {shape}.")
        out[name] = TensorInfo(file, dtype, shape, 8 + header_len + start)
    return out


def checkpoint_files(d: pathlib.Path) -> list[pathlib.Path]:
    """The safetensors files of a HF directory: the index's shards, or model.safetensors (clear errors)."""
    index, single = d / INDEX_NAME, d / SINGLE_NAME
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif single.is_file():
        names = [single.name]
    else:
        raise FileNotFoundError(
            f"{d} has neither {SINGLE_NAME} nor {INDEX_NAME}; only safetensors weights are supported "
            "(re-save with `model.save_pretrained(dir, safe_serialization=True)`)."
        )
    files = [d / n for n in names]
    for f in files:
        if not f.is_file():
            raise FileNotFoundError(f"{f} is listed in {INDEX_NAME} but does not exist (partial copy?).")
    return files


class SafetensorsDir:
    """The tensors of a HF safetensors directory, by name, read on demand (see the module docstring)."""

    def __init__(self, path: PathLike) -> None:
        self.path = pathlib.Path(path)
        if not self.path.is_dir():
            raise missing_path_error(self.path, "Model directory")
        self.infos: dict[str, TensorInfo] = {}
        for f in checkpoint_files(self.path):
            self.infos.update(read_header(f))

    def read(self, name: str, rows: slice = slice(None)) -> np.ndarray:
        """Rows `rows` (a step-1 slice of the first dim) of tensor `name`, in its stored dtype."""
        info = self.infos[name]
        n = info.shape[0] if info.shape else 1
        r0, r1, step = rows.indices(n)
        if step != 1:
            raise ValueError(f"read({name!r}): row slices must be contiguous, got step {step}")
        r1 = max(r0, r1)
        count = (r1 - r0) * info.row_elems
        offset = info.offset + r0 * info.row_elems * info.dtype.itemsize
        arr = np.fromfile(info.file, dtype=info.dtype, count=count, offset=offset)
        if arr.size != count:
            raise ValueError(f"{info.file}: tensor {name!r} is truncated (read {arr.size} of {count}).")
        return arr.reshape((r1 - r0, *info.shape[1:]) if info.shape else ())

    def read_float32(self, name: str) -> np.ndarray:
        """The whole tensor as float32 (bf16/f16 widened exactly): the all-float32 loader's view."""
        return self.read(name).astype(np.float32)


def write_safetensors(
    file: PathLike,
    shapes: dict[str, tuple[tuple[int, ...], np.dtype]],
    make: Callable[[str], np.ndarray],
    metadata: dict[str, str] | None = None,
) -> None:
    """Write a .safetensors file tensor by tensor: `shapes` fixes the names (in order), shapes and dtypes,
    `make(name)` produces each tensor when its turn comes (at most one is in memory at a time)."""
    header: dict[str, object] = {"__metadata__": metadata or {"format": "pt"}}
    pos = 0
    for name, (shape, dtype) in shapes.items():
        size = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        kind = _DTYPE_NAMES[np.dtype(dtype)]
        header[name] = {"dtype": kind, "shape": list(shape), "data_offsets": [pos, pos + size]}
        pos += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the format pads the header so the data starts 8-byte aligned
    with open(file, "wb") as fh:
        fh.write(len(raw).to_bytes(8, "little"))
        fh.write(raw)
        for name, (shape, dtype) in shapes.items():
            arr = np.ascontiguousarray(make(name), dtype=dtype)
            if arr.shape != tuple(shape):
                raise ValueError(f"write_safetensors: {name!r} has shape {arr.shape}, declared {shape}")
            arr.tofile(fh)


def write_index(d: PathLike, files: Iterable[tuple[str, Iterable[str]]], total_size: int) -> None:
    """model.safetensors.index.json for shards given as (file name, its tensor names)."""
    weight_map = {t: f for f, names in files for t in names}
    doc = {"metadata": {"total_size": int(total_size)}, "weight_map": weight_map}
    (pathlib.Path(d) / INDEX_NAME).write_text(json.dumps(doc, indent=2))
