"""Read and write `torch.save` files holding (nested) dicts of tensors, without importing torch.

Format (torch >= 1.6 zip serialization): a ZIP archive `<prefix>/data.pkl` (pickle protocol 2 of the
object, tensors as `torch._utils._rebuild_tensor_v2(storage, offset, size, stride, ...)` and storages
as persistent ids `("storage", torch.<Type>Storage, key, location, numel)`), the raw little-endian
storage bytes in `<prefix>/data/<key>`, plus `<prefix>/version` and `<prefix>/byteorder`.

Reading uses a restricted unpickler that only resolves the handful of globals such files contain (as
`torch.load(weights_only=True)` does); anything else is refused. Tensors come back as numpy arrays
(bfloat16 widened to float32). Written files load with `torch.load(..., weights_only=True)`.
"""
from __future__ import annotations

import collections
import io
import os
import pickle
import zipfile

import numpy as np

# torch storage class name -> numpy dtype (bfloat16 read as uint16 bits, widened later)
_STORAGE_DTYPES = {
    "FloatStorage": np.float32, "DoubleStorage": np.float64, "HalfStorage": np.float16,
    "BFloat16Storage": np.uint16, "LongStorage": np.int64, "IntStorage": np.int32, "ShortStorage": np.int16,
    "CharStorage": np.int8, "ByteStorage": np.uint8, "BoolStorage": np.bool_,
}
_DTYPE_STORAGE = {np.dtype(np.float32): "FloatStorage", np.dtype(np.float64): "DoubleStorage",
                  np.dtype(np.float16): "HalfStorage", np.dtype(np.int64): "LongStorage",
                  np.dtype(np.int32): "IntStorage", np.dtype(np.bool_): "BoolStorage"}


class TorchFileError(ValueError):
    """Not a torch zip checkpoint this reader understands (the message says why)."""


class _StorageType:
    def __init__(self, name: str):
        self.name = name
        self.dtype = np.dtype(_STORAGE_DTYPES[name])


class _Storage:
    def __init__(self, data: np.ndarray, bf16: bool):
        self.data, self.bf16 = data, bf16


def _rebuild_tensor_v2(storage: _Storage, offset, size, stride, requires_grad=False, hooks=None, metadata=None):
    size, stride = tuple(int(s) for s in size), tuple(int(s) for s in stride)
    base = storage.data
    if size and any(s == 0 for s in size):
        arr = np.zeros(size, base.dtype)
    else:
        extent = offset + sum((n - 1) * s for n, s in zip(size, stride)) + 1
        if offset < 0 or extent > base.size:
            raise TorchFileError(f"tensor view (offset {offset}, size {size}, stride {stride}) exceeds its "
                                 f"storage of {base.size} elements")
        arr = np.lib.stride_tricks.as_strided(base[offset:], shape=size,
                                              strides=tuple(s * base.itemsize for s in stride)).copy()
    if storage.bf16:
        arr = (arr.astype(np.uint32) << 16).view(np.float32)
    return arr


def _rebuild_parameter(data, requires_grad=False, hooks=None):
    return data


class _Unpickler(pickle.Unpickler):
    _GLOBALS = {
        ("collections", "OrderedDict"): collections.OrderedDict,
        ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor_v2,
        ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
        ("torch", "Size"): tuple,
    }

    def __init__(self, file, zf: zipfile.ZipFile, prefix: str, where: str):
        super().__init__(file)
        self.zf, self.prefix, self.where = zf, prefix, where
        self.storages: dict[str, _Storage] = {}

    def find_class(self, module, name):
        if (module, name) in self._GLOBALS:
            return self._GLOBALS[(module, name)]
        if module == "torch" and name in _STORAGE_DTYPES:
            return _StorageType(name)
        raise TorchFileError(f"{self.where}: refusing to load global {module}.{name} "
                             f"(only tensors and dicts of tensors are supported)")

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise TorchFileError(f"{self.where}: unsupported persistent id {pid!r}")
        _, stype, key, _location, numel = pid
        if not isinstance(stype, _StorageType):
            raise TorchFileError(f"{self.where}: unsupported storage type {stype!r}")
        if key not in self.storages:
            try:
                raw = self.zf.read(f"{self.prefix}data/{key}")
            except KeyError:
                raise TorchFileError(f"{self.where}: storage record data/{key} missing") from None
            data = np.frombuffer(raw, dtype=stype.dtype)
            if data.size < numel:
                raise TorchFileError(f"{self.where}: storage {key} has {data.size} elements, expected {numel}")
            self.storages[key] = _Storage(data, stype.name == "BFloat16Storage")
        return self.storages[key]


def load_torch_file(path: str | os.PathLike):
    """The object stored by `torch.save` (dicts / lists of tensors) with numpy arrays for tensors."""
    where = str(path)
    try:
        zf = zipfile.ZipFile(path)
    except zipfile.BadZipFile:
        raise TorchFileError(f"{where}: not a torch zip checkpoint (legacy torch < 1.6 files and "
                             f"non-torch files are not supported; re-save with a current torch)") from None
    with zf:
        pkl = [n for n in zf.namelist() if n.endswith("data.pkl")]
        if len(pkl) != 1:
            raise TorchFileError(f"{where}: expected one data.pkl record, found {pkl}")
        prefix = pkl[0][: -len("data.pkl")]
        order = f"{prefix}byteorder"
        if order in zf.namelist() and zf.read(order).strip() not in (b"little", b""):
            raise TorchFileError(f"{where}: big-endian torch files are not supported")
        with zf.open(pkl[0]) as f:
            try:
                return _Unpickler(io.BytesIO(f.read()), zf, prefix, where).load()
            except TorchFileError:
                raise
            except Exception as e:
                raise TorchFileError(f"{where}: could not unpickle: {e}") from None


# ----------------------------------------------------------------------------------------- writing
class _Global:
    """A reference to a global `module.name` written without importing it."""

    def __init__(self, module: str, name: str):
        self.module, self.name = module, name

    def __call__(self, *args):      # pickle requires reduce callables to be callable
        raise TypeError("placeholder for a torch global")


class _OutStorage:
    def __init__(self, key: str, array: np.ndarray):
        self.key, self.array = key, array


class _OutTensor:
    def __init__(self, storage: _OutStorage, shape: tuple[int, ...]):
        self.storage, self.shape = storage, shape

    def __reduce__(self):
        stride, acc = [], 1
        for n in reversed(self.shape):
            stride.append(acc)
            acc *= n
        return (_Global("torch._utils", "_rebuild_tensor_v2"),
                (self.storage, 0, tuple(self.shape), tuple(reversed(stride)), False, collections.OrderedDict()))


class _Pickler(pickle._Pickler):
    dispatch = pickle._Pickler.dispatch.copy()

    def _save_global_ref(self, obj):
        self.write(pickle.GLOBAL + f"{obj.module}\n{obj.name}\n".encode("utf-8"))
        self.memoize(obj)

    dispatch[_Global] = _save_global_ref

    def persistent_id(self, obj):
        if isinstance(obj, _OutStorage):
            return ("storage", _Global("torch", _DTYPE_STORAGE[obj.array.dtype]), obj.key, "cpu", obj.array.size)
        return None


def save_torch_file(path: str | os.PathLike, tensors: dict[str, np.ndarray]) -> None:
    """Write an ordered dict name -> array as `torch.save` would (float32/64/16, int32/64, bool)."""
    storages, obj = [], collections.OrderedDict()
    for name, arr in tensors.items():
        arr = np.asarray(arr)
        arr = np.ascontiguousarray(arr).reshape(arr.shape)     # (ascontiguousarray makes 0-d arrays 1-d)
        if arr.dtype not in _DTYPE_STORAGE:
            raise TypeError(f"tensor {name!r}: unsupported dtype {arr.dtype}")
        st = _OutStorage(str(len(storages)), arr)
        storages.append(st)
        obj[name] = _OutTensor(st, arr.shape)
    buf = io.BytesIO()
    _Pickler(buf, protocol=2).dump(obj)
    prefix = "archive/"
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED) as zf:
        zf.writestr(prefix + "data.pkl", buf.getvalue())
        zf.writestr(prefix + "byteorder", "little")
        for st in storages:
            zf.writestr(f"{prefix}data/{st.key}", st.array.astype(st.array.dtype.newbyteorder("<")).tobytes())
        zf.writestr(prefix + "version", "3\n")
