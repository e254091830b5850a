"""Hugging Face FP8 checkpoints (docs/CONTRACT.md §4): reading and writing block-FP8 linear weights in safetensors
files.

A linear layer `<prefix>` is stored as `<prefix>.weight` (N, K) float8_e4m3fn, `<prefix>.weight_scale_inv`
(ceil(N/gn), ceil(K/gk)) float32 block scales and an optional `<prefix>.bias`; the checkpoint's config.json names the
block size (`quantization_config.weight_block_size`). `jaxfp8.weights` re-exports the public functions.

Checkpoints are read with the `safetensors` library (optional extra `jaxfp8[checkpoints]`). Its NumPy reader has no
float8 types (safetensors issue #682: it looks up `numpy.float8_e4m3fn`), so fp8 tensors that it refuses are mapped
from the file by their offsets in the safetensors header and viewed as `ml_dtypes.float8_e4m3fn`: no copy until the
arrays go to a device.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import ml_dtypes
import numpy as np

from jaxfp8 import _checks
from jaxfp8.weights import DEFAULT_BLOCK_SIZE, FP8, Fp8LinearWeight, _check_scale_shape

WEIGHT_SUFFIX = ".weight"
SCALE_SUFFIX = ".weight_scale_inv"
BIAS_SUFFIX = ".bias"
DEFAULT_FILE_NAME = "model.safetensors"
# config.json's quantization_config of a block-FP8 checkpoint, less weight_block_size: what transformers'
# FineGrainedFP8Config and DeepSeek-V3's config say (weights e4m3 with block scales, activations quantized per call).
QUANTIZATION_CONFIG = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3"}
# safetensors dtype names of the types its NumPy reader may refuse, and what they are.
_RAW_DTYPES = {"F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn), "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
               "BF16": np.dtype(ml_dtypes.bfloat16)}


def _safetensors():
  try:
    import safetensors  # noqa: F401
    from safetensors import numpy as safetensors_numpy
  except ImportError as e:
    raise ImportError("reading and writing checkpoints needs the safetensors package: "
                      "pip install 'jaxfp8[checkpoints]' (or pip install safetensors)") from e
  return safetensors, safetensors_numpy


def checkpoint_files(path: str | os.PathLike | Sequence[str | os.PathLike]) -> list[Path]:
  """The safetensors files of a checkpoint: a file, a list of files, or a directory (the files its
  `model.safetensors.index.json` names, else every `*.safetensors` file in it)."""
  if isinstance(path, (str, os.PathLike)):
    path = Path(path)
    if path.is_dir():
      index = path / "model.safetensors.index.json"
      if index.is_file():
        weight_map = _read_json_object(index).get("weight_map", {})
        if not isinstance(weight_map, dict):
          raise ValueError(f"{str(index)!r}: weight_map must be a JSON object, got {weight_map!r:.80}")
        files = [path / name for name in sorted(set(weight_map.values()))]
      else:
        files = sorted(path.glob("*.safetensors"))
      if not files:
        raise FileNotFoundError(f"no *.safetensors files in the directory {str(path)!r}")
    else:
      files = [path]
  else:
    if isinstance(path, bytes) or not isinstance(path, Sequence) or not all(
        isinstance(p, (str, os.PathLike)) for p in path):
      raise TypeError(f"path must be a file or directory path or a list of file paths, got {path!r}")
    if not path:
      raise ValueError("path is an empty list of checkpoint files")
    files = [Path(p) for p in path]
  for f in files:
    if not f.is_file():
      raise FileNotFoundError(f"checkpoint file {str(f)!r} does not exist")
  return files


def _read_json_object(path: Path) -> dict:
  """The JSON object in the file at `path`; a ValueError naming the file if it holds anything else."""
  try:
    value = json.loads(path.read_text())
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise ValueError(f"{str(path)!r} is not valid JSON: {e}") from None
  if not isinstance(value, dict):
    raise ValueError(f"{str(path)!r} must hold a JSON object, got {type(value).__name__} {value!r:.80}")
  return value


def _quantization_config(config: Path, value: dict) -> dict | None:
  quant = value.get("quantization_config")
  if quant is not None and not isinstance(quant, dict):
    raise ValueError(f"{str(config)!r}: quantization_config must be a JSON object, got {quant!r}")
  return quant


def _config_block_size(config: Path, block) -> tuple[int, int]:
  """`weight_block_size` as found in `config`: a JSON list of two positive integers."""
  try:
    if not isinstance(block, list):
      raise TypeError("not a JSON list")
    return _checks.block_size(block)
  except (TypeError, ValueError) as e:
    raise ValueError(f"{str(config)!r}: quantization_config.weight_block_size must be [gn, gk], two positive "
                     f"integers, got {block!r} ({e})") from None


def read_block_size(directory: str | os.PathLike) -> tuple[int, int] | None:
  """`quantization_config.weight_block_size` of the checkpoint's config.json, if it has one.

  Raises ValueError naming the file if config.json is not a JSON object or the block size is not two positive ints.
  """
  config = Path(directory) / "config.json"
  if not config.is_file():
    return None
  quant = _quantization_config(config, _read_json_object(config))
  block = None if quant is None else quant.get("weight_block_size")
  return None if block is None else _config_block_size(config, block)


def _read_header(f, path: Path) -> tuple[int, dict]:
  """(data start, tensor table) of an open safetensors file: an 8-byte little-endian header length, then JSON."""
  size = os.fstat(f.fileno()).st_size
  head = f.read(8)
  length = struct.unpack("<Q", head)[0] if len(head) == 8 else None
  if length is None or length > size - 8:
    raise ValueError(f"{str(path)!r} is not a safetensors file: its {size} bytes cannot hold the header length "
                     f"{length}")
  table = json.loads(f.read(length))
  if not isinstance(table, dict):
    raise ValueError(f"{str(path)!r} is not a safetensors file: its header is not a JSON object")
  return 8 + length, table


class _OpenFile:
  """A safetensors file open for reading: safetensors' handle and, for the tensors its NumPy reader refuses, the
  header and a memory map read from one open file of our own.

  The header is read on every open, never cached across opens: a file replaced in place with its mtime kept (`cp -p`,
  `rsync -t`, tar) would otherwise be read with the old file's offsets. Offsets and the map come from the same open
  file, so they always describe the same bytes.
  """

  def __init__(self, safetensors, path: Path):
    self.path = path
    self.handle = safetensors.safe_open(str(path), framework="numpy").__enter__()
    self._file = None
    self._header: tuple[int, dict] | None = None

  def close(self) -> None:
    self.handle.__exit__(None, None, None)
    if self._file is not None:
      self._file.close()

  def read(self, name: str) -> np.ndarray:
    """One tensor as a NumPy array (fp8 and bf16 as ml_dtypes arrays)."""
    dtype_name = self.handle.get_slice(name).get_dtype()
    try:
      array = self.handle.get_tensor(name)
    except (AttributeError, TypeError, KeyError):
      # safetensors' NumPy reader has no float8 type (it asks numpy for one): map the bytes ourselves.
      if dtype_name not in _RAW_DTYPES:
        raise
      return self._map(name, dtype_name)
    if dtype_name in _RAW_DTYPES and array.dtype != _RAW_DTYPES[dtype_name]:
      array = array.view(_RAW_DTYPES[dtype_name])  # a reader that hands out raw bytes (uint8) for fp8
    return array

  def _map(self, name: str, dtype_name: str) -> np.ndarray:
    if self._header is None:
      self._file = open(self.path, "rb")
      self._header = _read_header(self._file, self.path)
    start, table = self._header
    info = table.get(name)
    shape = list(self.handle.get_slice(name).get_shape())
    dtype = _RAW_DTYPES[dtype_name]
    if not isinstance(info, dict) or info.get("dtype") != dtype_name or list(info.get("shape", ())) != shape:
      raise ValueError(f"{str(self.path)!r} changed while it was read: its header now describes {name!r} as "
                       f"{info!r}, not {dtype_name} {shape}")
    begin, end = info["data_offsets"]
    size = os.fstat(self._file.fileno()).st_size
    if end - begin != int(np.prod(shape)) * dtype.itemsize or begin < 0 or start + end > size:
      raise ValueError(f"{str(self.path)!r}: the offsets [{begin}, {end}) of {name!r} do not fit its shape {shape} "
                       f"and {dtype_name} or the file's {size} bytes")
    if begin == end:
      return np.empty(shape, dtype)
    raw = np.memmap(self._file, dtype=np.uint8, mode="r", offset=start + begin, shape=(end - begin,))
    return raw.view(dtype).reshape(shape)


def _selected(prefix: str, select) -> bool:
  if select is None:
    return True
  if callable(select):
    return bool(select(prefix))
  return prefix in select


def _placement(sharding, prefix: str, field: str, shape: tuple[int, ...]):
  if callable(sharding) and not isinstance(sharding, (jax.sharding.Sharding, jax.Device)):
    return sharding(prefix, field, shape)
  return sharding


# safetensors dtype names -> NumPy's, for error messages.
_DTYPE_NAMES = {"F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "BF16": "bfloat16", "F16": "float16",
                "F32": "float32", "F64": "float64", "U8": "uint8", "I8": "int8", "I16": "int16", "I32": "int32",
                "I64": "int64", "BOOL": "bool"}


def _index(safetensors, files: Sequence[Path]) -> tuple[dict[str, Path], dict[str, str]]:
  """Every tensor name -> its file and its safetensors dtype name (a weight and its scales may sit in different
  files of a sharded checkpoint)."""
  location: dict[str, Path] = {}
  dtypes: dict[str, str] = {}
  for f in files:
    with safetensors.safe_open(str(f), framework="numpy") as handle:
      for name in handle.keys():
        location[name] = f
        dtypes[name] = handle.get_slice(name).get_dtype()
  return location, dtypes


def _layer_prefixes(dtypes: Mapping[str, str]) -> list[str]:
  """The prefixes of the block-FP8 linear layers: every `<prefix>.weight` stored as e4m3 and every
  `<prefix>.weight_scale_inv`, which promises one."""
  prefixes = {name[:-len(WEIGHT_SUFFIX)] for name, dtype in dtypes.items()
              if name.endswith(WEIGHT_SUFFIX) and dtype == "F8_E4M3"}
  prefixes.update(name[:-len(SCALE_SUFFIX)] for name in dtypes if name.endswith(SCALE_SUFFIX))
  return sorted(prefixes)


def _check_layer_tensors(prefix: str, dtypes: Mapping[str, str]) -> None:
  """A layer has an e4m3 `weight` and its `weight_scale_inv` (docs/CONTRACT.md §4): one without the other, or a weight
  of another type beside block scales, is refused, never skipped."""
  weight, scale = prefix + WEIGHT_SUFFIX, prefix + SCALE_SUFFIX
  if weight not in dtypes:
    raise ValueError(f"{scale!r} has no weight {weight!r} in the files read (a file of a sharded checkpoint read "
                     "alone?): block scales must come with their float8_e4m3fn weight")
  if dtypes[weight] != "F8_E4M3":
    dtype = dtypes[weight]
    raise ValueError(f"{weight!r} has dtype {dtype} ({_DTYPE_NAMES.get(dtype, 'unknown')}), but {scale!r} beside "
                     "it promises a block-FP8 float8_e4m3fn weight: only e4m3 weights with block scales are "
                     "supported")
  if scale not in dtypes:
    others = sorted(n for n in dtypes if n.startswith(prefix + ".") and n != weight)
    raise ValueError(f"{weight!r} is float8_e4m3fn but has no {scale!r} (block scales); found "
                     f"{others or 'nothing else'} for this layer. Only the blockwise Hugging Face FP8 convention "
                     "(weight + weight_scale_inv) is supported")


def _read_layer(prefix: str, read: Callable[[str], np.ndarray], names: Mapping[str, Any],
                block_size: tuple[int, int]) -> dict[str, np.ndarray | None]:
  """The arrays of one layer, checked: w_q (N, K), w_s of the block size's shape (as float32), bias (N,) or None."""
  weight, scale, bias_name = prefix + WEIGHT_SUFFIX, prefix + SCALE_SUFFIX, prefix + BIAS_SUFFIX
  w_q = read(weight)
  if w_q.ndim != 2:
    raise ValueError(f"{weight!r} must be 2-D (N, K), got shape {w_q.shape}")
  w_s = read(scale)
  if not np.issubdtype(w_s.dtype, np.floating) and w_s.dtype != _RAW_DTYPES["BF16"]:
    raise TypeError(f"{scale!r} must be floating point, got {w_s.dtype}")
  try:
    _check_scale_shape(w_q.shape, w_s.shape, block_size, repr(scale))
  except ValueError as e:
    raise ValueError(f"{e}; pass the checkpoint's block_size") from None
  bias = read(bias_name) if bias_name in names else None
  if bias is not None and tuple(bias.shape) != (w_q.shape[0],):
    raise ValueError(f"{bias_name!r} must have shape ({w_q.shape[0]},), got {tuple(bias.shape)}")
  return {"w_q": w_q, "w_s": w_s.astype(np.float32, copy=False), "bias": bias}


def load_hf_fp8_linears(
    path: str | os.PathLike | Sequence[str | os.PathLike],
    *,
    block_size: tuple[int, int] | None = None,
    select: Callable[[str], bool] | Iterable[str] | None = None,
    sharding: Any = None,
    as_numpy: bool = False,
) -> dict[str, Fp8LinearWeight]:
  """Reads every block-FP8 linear weight of a Hugging Face FP8 checkpoint (safetensors files).

  A linear layer `<prefix>` is a `<prefix>.weight` stored as float8_e4m3fn (F8_E4M3) with its
  `<prefix>.weight_scale_inv` float32 block scales (the DeepSeek-V3 / Qwen3-FP8 convention); a `<prefix>.bias`, if
  present, comes along. Tensors of other types without block scales (norms, embeddings, bf16 layers) are left out.
  A weight and its scales may sit in different files of a sharded checkpoint.

  Args:
    path: a .safetensors file, a list of them, or the checkpoint directory.
    block_size: (gn, gk); None: the directory's config.json `quantization_config.weight_block_size`, else (128, 128).
      Every scale array must have shape (ceil(N/gn), ceil(K/gk)).
    select: which prefixes to load: a predicate or a collection of prefixes (None: all).
    sharding: where the arrays go: None (the default device), a Device or Sharding for all of them, or a callable
      (prefix, field, shape) -> Device | Sharding | None, field being "w_q", "w_s" or "bias".
    as_numpy: return NumPy arrays (memory-mapped where possible) instead of device arrays.

  Returns:
    {prefix: Fp8LinearWeight}, sorted by prefix.

  Raises:
    ValueError (for the selected layers): an e4m3 weight without `weight_scale_inv` (e.g. a per-tensor FP8
      checkpoint), a `weight_scale_inv` without its weight or beside a weight of another dtype (e5m2, uint8, bf16,
      ...), or scales whose shape does not fit the block size.
  """
  if select is not None and not callable(select) and (isinstance(select, (str, bytes)) or not isinstance(
      select, Iterable)):
    raise TypeError(f"select must be None, a predicate or a collection of prefixes, got {select!r}")
  as_numpy = _checks.flag("as_numpy", as_numpy)
  safetensors, _ = _safetensors()
  files = checkpoint_files(path)
  if block_size is None:
    directory = Path(path) if isinstance(path, (str, os.PathLike)) and Path(path).is_dir() else files[0].parent
    block_size = read_block_size(directory) or DEFAULT_BLOCK_SIZE
  block_size = _checks.block_size(block_size)
  location, dtypes = _index(safetensors, files)
  opened: dict[Path, _OpenFile] = {}

  def read(name: str) -> np.ndarray:
    f = location[name]
    if f not in opened:
      opened[f] = _OpenFile(safetensors, f)
    return opened[f].read(name)

  out: dict[str, Fp8LinearWeight] = {}
  try:
    for prefix in _layer_prefixes(dtypes):
      if not _selected(prefix, select):
        continue
      _check_layer_tensors(prefix, dtypes)
      arrays = _read_layer(prefix, read, location, block_size)
      if not as_numpy:
        arrays = {field: None if a is None else jax.device_put(a, _placement(sharding, prefix, field, a.shape))
                  for field, a in arrays.items()}
      out[prefix] = Fp8LinearWeight(arrays["w_q"], arrays["w_s"], arrays["bias"], block_size)
  finally:
    for f in opened.values():
      f.close()
  return out


def read_tensors(path: str | os.PathLike | Sequence[str | os.PathLike], names: Iterable[str], *,
                 optional: Iterable[str] = ()) -> dict[str, np.ndarray]:
  """Tensors of a checkpoint by name, as they are stored, copied out of the file (fp8 and bf16 as ml_dtypes arrays):
  the float tensors beside the FP8 linears (routers, norms, biases). A name in `names` that no file holds is a
  KeyError naming it; one in `optional` is left out of the result."""
  safetensors, _ = _safetensors()
  files = checkpoint_files(path)
  location, _ = _index(safetensors, files)
  optional = set(optional)
  wanted = list(names) + [name for name in optional if name in location]
  missing = [name for name in wanted if name not in location]
  if missing:
    raise KeyError(f"{missing} not found in {[str(f) for f in files]}")
  opened: dict[Path, _OpenFile] = {}
  try:
    out = {}
    for name in wanted:
      f = location[name]
      if f not in opened:
        opened[f] = _OpenFile(safetensors, f)
      out[name] = np.array(opened[f].read(name))
    return out
  finally:
    for f in opened.values():
      f.close()


def tensor_names(path: str | os.PathLike | Sequence[str | os.PathLike]) -> list[str]:
  """The names of every tensor in a checkpoint's files, sorted (from the headers: nothing is read)."""
  safetensors, _ = _safetensors()
  location, _ = _index(safetensors, checkpoint_files(path))
  return sorted(location)


def _tensors_to_save(prefix, weight) -> dict[str, np.ndarray]:
  """The tensors of one layer, checked as the loader checks them (so that what is saved loads back)."""
  if not isinstance(prefix, str) or not prefix:
    raise TypeError(f"weights must map non-empty str prefixes to Fp8LinearWeight, got the key {prefix!r}")
  name = f"weights[{prefix!r}]"
  if not isinstance(weight, Fp8LinearWeight):
    raise TypeError(f"{name} must be an Fp8LinearWeight, got {type(weight).__name__}")
  _checks.array(f"{name}.w_q", weight.w_q, (FP8,))
  _checks.array(f"{name}.w_s", weight.w_s, (np.dtype(np.float32),))
  _check_scale_shape(tuple(weight.w_q.shape), tuple(weight.w_s.shape), _checks.block_size(weight.block_size),
                     f"{name}.w_s")
  tensors = {prefix + WEIGHT_SUFFIX: np.asarray(weight.w_q), prefix + SCALE_SUFFIX: np.asarray(weight.w_s)}
  if weight.bias is not None:
    _checks.array(f"{name}.bias", weight.bias, _checks.FLOAT_DTYPES, ndim=None)
    n, k = weight.w_q.shape
    if tuple(weight.bias.shape) != (n,):
      raise ValueError(f"{name}.bias must have shape (N,) = ({n},) for its ({n}, {k}) weight, got "
                       f"{tuple(weight.bias.shape)}")
    tensors[prefix + BIAS_SUFFIX] = np.asarray(weight.bias)
  return tensors


def _common_block_size(weights: Mapping[str, Fp8LinearWeight]) -> tuple[int, int] | None:
  """The block size every weight has (a checkpoint has one: config.json's weight_block_size); None if no weights."""
  first = None
  for prefix, weight in weights.items():
    block_size = _checks.block_size(weight.block_size)
    if first is None:
      first = (prefix, block_size)
    elif block_size != first[1]:
      raise ValueError(f"a checkpoint has one block size (config.json's weight_block_size), but weights[{first[0]!r}] "
                       f"has {first[1]} and weights[{prefix!r}] has {block_size}: save them to separate checkpoints")
  return None if first is None else first[1]


def _merged_config(config: Path, block_size: tuple[int, int]) -> dict | None:
  """The content of `config` (config.json) with the quantization_config of these weights merged in, every other key
  kept; None when it says so already. A value it holds that differs from ours is refused: it describes the other
  files of the directory, which would then be read wrongly."""
  ours = {**QUANTIZATION_CONFIG, "weight_block_size": list(block_size)}
  value = _read_json_object(config) if config.is_file() else {}
  quant = _quantization_config(config, value) or {}
  for key, want in ours.items():
    have = quant.get(key)
    if key == "weight_block_size" and have is not None:
      have = list(_config_block_size(config, have))
    if have is not None and have != want:
      raise ValueError(f"{str(config)!r} says quantization_config.{key} = {json.dumps(quant[key])}, but these "
                       f"weights need {json.dumps(want)}: the directory's other files would be read with the wrong "
                       "value. Save into another directory, or pass config=False")
  if all(key in quant for key in ours):
    return None
  return {**value, "quantization_config": {**ours, **quant}}


def _write_json(path: Path, value: dict) -> None:
  # Written beside the target and renamed over it, so that a reader never sees half a config.json.
  tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
  tmp.write_text(json.dumps(value, indent=2) + "\n")
  os.replace(tmp, path)


def save_hf_fp8_linears(
    path: str | os.PathLike,
    weights: Mapping[str, Fp8LinearWeight],
    *,
    extra: Mapping[str, Any] | None = None,
    metadata: Mapping[str, str] | None = None,
    config: bool = True,
) -> None:
  """Writes linear weights in the Hugging Face FP8 convention (`<prefix>.weight` F8_E4M3, `<prefix>.weight_scale_inv`
  F32, `<prefix>.bias`) to one safetensors file, with any `extra` tensors as they are, and the config.json beside it
  that says how they are quantized (docs/CONTRACT.md §4).

  Args:
    path: the .safetensors file, or a directory to write `model.safetensors` into.
    weights: {prefix: Fp8LinearWeight}, all of one block size (a checkpoint has one).
    extra: other tensors to store as they are (norms, embeddings, ...).
    metadata: the safetensors header metadata (default {"format": "pt"}, what transformers expects).
    config: write the `quantization_config` ({"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
      "weight_block_size": [gn, gk]}) into the config.json of the file's directory, creating it or merging into it
      (every other key of an existing config.json is kept). A config.json that already says another value for one
      of these keys is refused. Nothing is written to config.json when `weights` is empty.

  Every weight is checked first, as the loader would check it (w_q (N, K) e4m3fn, w_s float32 of the block size's
  shape, bias (N,) bfloat16, float16 or float32), and config.json too: on an error nothing is written.
  """
  _, safetensors_numpy = _safetensors()
  if not isinstance(weights, Mapping):
    raise TypeError(f"weights must be a mapping {{prefix: Fp8LinearWeight}}, got {type(weights).__name__}")
  config = _checks.flag("config", config)
  file = Path(path)
  if file.is_dir():
    file = file / DEFAULT_FILE_NAME
  tensors: dict[str, np.ndarray] = {}
  for prefix, weight in weights.items():
    tensors.update(_tensors_to_save(prefix, weight))
  for name, value in (extra or {}).items():
    if name in tensors:
      raise ValueError(f"extra tensor {name!r} collides with a linear weight's tensor")
    tensors[name] = np.asarray(value)
  block_size = _common_block_size(weights)
  config_path = file.parent / "config.json"
  merged = _merged_config(config_path, block_size) if config and block_size is not None else None
  safetensors_numpy.save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(file),
                              metadata=dict(metadata or {"format": "pt"}))
  if merged is not None:
    _write_json(config_path, merged)

__all__ = ["checkpoint_files", "read_block_size", "load_hf_fp8_linears", "save_hf_fp8_linears", "read_tensors",
           "tensor_names"]
