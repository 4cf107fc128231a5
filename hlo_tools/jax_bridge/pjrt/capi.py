"""A small ctypes binding of the PJRT C API: just what compiling HLO with a plugin needs.

XLA:GPU takes a module in its ``hlo`` program format (a serialized ``HloModuleProto``)
only through the PJRT C API: jax's own client hands the plugin portable StableHLO, which
cannot carry our hand-written ``fusion`` instructions. This module loads a plugin's
shared library and calls, through the function table its ``GetPjrtApi`` returns:

* deviceless compiles: a topology made from a ``GpuTargetConfigProto`` text, compiled
  for with no client (:func:`deviceless_optimized_program`);
* compiles on a real device: a client, its compile, the executable's serialization
  (:func:`client_serialized_executable`).

Layout notes. The function table only ever grows at its end, and an argument struct only
gains fields at its end, so the prefix this binding declares is valid for every plugin
at or above the API version it was written against (0.90); :data:`MIN_API_VERSION`
checks it on load. Each argument struct's ``struct_size`` is its declared size; a plugin
rejects a size smaller than its own, so a struct it has grown would need trailing zeroed
padding here (see ``_PAD``): none is needed for the plugins of jax 0.10.2 (C API 0.112)
and 0.12 (0.116), whose size checks accept every struct declared here.

The binding imports nothing from jax: the child process of a compile
(:mod:`~hlo_tools.jax_bridge.pjrt.child`) runs it with jax unimported. Errors the
plugin returns become :class:`PjrtError` (with the absl status code).
"""

from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Iterator, Mapping
from typing import Any, NamedTuple

from hlo_tools.jax_bridge.errors import HloCompileError

__all__ = [
    "ERROR_CODES",
    "MIN_API_VERSION",
    "NamedValues",
    "OptimizedProgram",
    "Plugin",
    "PjrtError",
    "client_serialized_executable",
    "code_name",
    "deviceless_optimized_program",
    "hlo_module_of",
    "proto_field",
]

#: The oldest PJRT C API (major, minor) whose function table and argument structs hold
#: everything this binding declares.
MIN_API_VERSION = (0, 90)

#: absl status code -> name, as the plugin reports them in ``PJRT_Error_GetCode``.
ERROR_CODES = (
    "OK", "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "NOT_FOUND",
    "ALREADY_EXISTS", "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION",
    "ABORTED", "OUT_OF_RANGE", "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE", "DATA_LOSS",
    "UNAUTHENTICATED",
)


def code_name(code: int) -> str:
    """An absl status code's name (``"INVALID_ARGUMENT"``, ...); ``"?"`` if unknown."""
    return ERROR_CODES[code] if 0 <= code < len(ERROR_CODES) else "?"


class PjrtError(HloCompileError):
    """The plugin returned an error (or could not be loaded).

    Attributes:
        code: the absl status code (``ERROR_CODES[code]`` names it); -1: not the
            plugin's own error (e.g. the library would not load).
    """

    def __init__(self, message: str, code: int = -1) -> None:
        super().__init__(message)
        self.code = code

    @property
    def code_name(self) -> str:
        """The status code's name (:func:`code_name`)."""
        return code_name(self.code)


# ------------------------------------------------------------------ struct layouts

_P = ctypes.c_void_p
_SIZE = ctypes.c_size_t
_HEAD = [("struct_size", _SIZE), ("extension_start", _P)]
#: Extra zeroed bytes after a struct's declared fields, per struct (the API function's
#: name, ``Compile`` for ``PJRT_Compile_Args``), for a plugin that expects a larger
#: struct than the one declared here (none needed so far).
_PAD: dict[str, int] = {}


class _Args(ctypes.Structure):
    """An argument struct (made by :func:`_args`): constructed with ``struct_size`` set
    and every other field zeroed unless given."""

    def __init__(self, **fields: Any) -> None:
        super().__init__(struct_size=ctypes.sizeof(self), **fields)


def _args(name: str, *body: tuple[str, Any], anonymous: tuple[str, ...] = ()) -> Any:
    """An argument struct type: the common head, ``body``, then ``_PAD[name]`` bytes."""
    pad = _PAD.get(name, 0)
    fields = _HEAD + list(body) + ([("_pad", ctypes.c_uint8 * pad)] if pad else [])
    return type(name, (_Args,), {"_fields_": fields, "_anonymous_": anonymous})


class _NamedValueData(ctypes.Union):
    _fields_ = [("string_value", ctypes.c_char_p), ("int64_value", ctypes.c_int64),
                ("int64_array_value", ctypes.POINTER(ctypes.c_int64)),
                ("float_value", ctypes.c_float), ("bool_value", ctypes.c_bool)]


_Deleter = ctypes.CFUNCTYPE(None, _P)
_ApiVersion = _args("ApiVersion", ("major_version", ctypes.c_int),
                    ("minor_version", ctypes.c_int))
_NamedValue = _args("NamedValue", ("name", ctypes.c_char_p), ("name_size", _SIZE),
                    ("type", ctypes.c_int), ("value", _NamedValueData),
                    ("value_size", _SIZE), anonymous=("value",))
_Program = _args("Program", ("code", _P), ("code_size", _SIZE),
                 ("format", ctypes.c_char_p), ("format_size", _SIZE))
_ErrorDestroy = _args("Error_Destroy", ("error", _P))
_ErrorMessage = _args("Error_Message", ("error", _P), ("message", _P),
                      ("message_size", _SIZE))
_ErrorGetCode = _args("Error_GetCode", ("error", _P), ("code", ctypes.c_int))
_PluginInitialize = _args("Plugin_Initialize")
_ClientCreate = _args("Client_Create", ("create_options", _P), ("num_options", _SIZE),
                      ("kv_get_callback", _P), ("kv_get_user_arg", _P),
                      ("kv_put_callback", _P), ("kv_put_user_arg", _P), ("client", _P),
                      ("kv_try_get_callback", _P), ("kv_try_get_user_arg", _P))
_ClientDestroy = _args("Client_Destroy", ("client", _P))
_ClientCompile = _args("Client_Compile", ("client", _P), ("program", _P),
                       ("compile_options", ctypes.c_char_p),
                       ("compile_options_size", _SIZE), ("executable", _P))
_ExecutableDestroy = _args("Executable_Destroy", ("executable", _P))
_ExecutableOptimizedProgram = _args("Executable_OptimizedProgram", ("executable", _P),
                                    ("program", _P))
_ExecutableSerialize = _args("Executable_Serialize", ("executable", _P),
                             ("serialized_bytes", _P), ("serialized_bytes_size", _SIZE),
                             ("serialized_executable", _P),
                             ("serialized_executable_deleter", _Deleter))
_LoadedExecutableDestroy = _args("LoadedExecutable_Destroy", ("executable", _P))
_LoadedExecutableGetExecutable = _args("LoadedExecutable_GetExecutable",
                                       ("loaded_executable", _P), ("executable", _P))
_TopologyCreate = _args("TopologyDescription_Create", ("topology_name", ctypes.c_char_p),
                        ("topology_name_size", _SIZE), ("create_options", _P),
                        ("num_options", _SIZE), ("topology", _P))
_TopologyDestroy = _args("TopologyDescription_Destroy", ("topology", _P))
_Compile = _args("Compile", ("topology", _P), ("program", _P),
                 ("compile_options", ctypes.c_char_p), ("compile_options_size", _SIZE),
                 ("client", _P), ("executable", _P))


#: The function table's slots in order, up to the last one this binding calls
#: (``PJRT_Compile``); ``None`` marks slots it never calls, by group and count.
_SLOTS: tuple[str | None, ...] = (
    "Error_Destroy", "Error_Message", "Error_GetCode",
    "Plugin_Initialize", None,                                  # + Plugin_Attributes
    *(None,) * 5,                                               # Event_*
    "Client_Create", "Client_Destroy", *(None,) * 8,            # Client_PlatformName..
    "Client_Compile", None, None,                               # ..BufferFromHostBuffer
    *(None,) * 6,                                               # DeviceDescription_*
    *(None,) * 6,                                               # Device_*
    *(None,) * 5,                                               # Memory_*
    "Executable_Destroy", *(None,) * 7,                         # Executable_Name..
    "Executable_OptimizedProgram", "Executable_Serialize",
    "LoadedExecutable_Destroy", "LoadedExecutable_GetExecutable", *(None,) * 6,
    *(None,) * 19,                                              # Buffer_*
    *(None,) * 5,                                               # CopyToDeviceStream_*
    "TopologyDescription_Create", "TopologyDescription_Destroy", *(None,) * 5,
    "Compile",
)


class _Api(ctypes.Structure):
    _fields_ = [("struct_size", _SIZE), ("extension_start", _P),
                ("pjrt_api_version", _ApiVersion),
                *((name or f"_slot{i}", _P) for i, name in enumerate(_SLOTS))]


_ERROR_FN = ctypes.CFUNCTYPE(_P, _P)    # PJRT_Error* fn(Args*)
_VOID_FN = ctypes.CFUNCTYPE(None, _P)   # void fn(Args*): the Error_* functions


# ------------------------------------------------------------------ named values


class NamedValues:
    """A C array of ``PJRT_NamedValue`` from a mapping of str / int / float / bool
    values (by exact type: ``True`` is a bool option, not an int), kept alive with its
    strings for as long as this object lives."""

    _KINDS = {str: 0, int: 1, float: 3, bool: 4}

    def __init__(self, values: Mapping[str, Any]) -> None:
        self._keep: list[bytes] = []
        self.array = (_NamedValue * max(len(values), 1))()
        self.count = len(values)
        for slot, (name, value) in zip(self.array, values.items()):
            self._fill(slot, name, value)

    def _bytes(self, text: str) -> bytes:
        data = text.encode()
        self._keep.append(data)
        return data

    def _fill(self, slot: _NamedValue, name: str, value: Any) -> None:
        kind = next((k for t, k in self._KINDS.items() if type(value) is t), None)
        if kind is None:
            raise TypeError(f"option {name!r}: unsupported value type {type(value).__name__}")
        key = self._bytes(name)
        slot.struct_size = ctypes.sizeof(_NamedValue)  # array slots are not __init__'ed
        slot.name, slot.name_size, slot.type, slot.value_size = key, len(key), kind, 1
        if kind == 0:
            data = self._bytes(value)
            slot.string_value, slot.value_size = data, len(data)
        elif kind == 1:
            slot.int64_value = value
        elif kind == 3:
            slot.float_value = value
        else:
            slot.bool_value = value

    @property
    def pointer(self) -> int | None:
        """The array's address (None for no values)."""
        return ctypes.addressof(self.array) if self.count else None


# ------------------------------------------------------------------ the plugin


class OptimizedProgram(NamedTuple):
    """A compiled executable's optimized program.

    Attributes:
        code: its bytes (for ``format == "hlo"``: a serialized ``HloModuleProto``).
        format: the format the plugin names (``"hlo"``, ...).
    """

    code: bytes
    format: str


class Plugin:
    """A loaded PJRT plugin: its function table, initialized once per process.

    Args:
        path: the plugin's shared library.

    Raises:
        PjrtError: the library does not load, has no ``GetPjrtApi``, or its API is
            older than :data:`MIN_API_VERSION`.
    """

    _initialized: set[str] = set()

    def __init__(self, path: str) -> None:
        try:
            self._lib = ctypes.CDLL(path, mode=ctypes.RTLD_LOCAL)
            get_api = self._lib.GetPjrtApi
        except (OSError, AttributeError) as err:
            raise PjrtError(f"cannot load PJRT plugin {path}: {err}") from err
        get_api.restype = ctypes.POINTER(_Api)
        get_api.argtypes = []
        self._api = get_api().contents
        self.version = (self._api.pjrt_api_version.major_version,
                        self._api.pjrt_api_version.minor_version)
        if self.version < MIN_API_VERSION or self._api.struct_size < ctypes.sizeof(_Api):
            raise PjrtError(f"PJRT plugin {path} has C API {self.version}, this binding "
                            f"needs >= {MIN_API_VERSION}")
        if path not in Plugin._initialized:
            self.call("Plugin_Initialize", _PluginInitialize())
            Plugin._initialized.add(path)

    def _function(self, name: str, prototype: Any) -> Any:
        address = getattr(self._api, name)
        if not address:
            raise PjrtError(f"the PJRT plugin does not implement PJRT_{name}", 12)
        return prototype(address)

    def _error(self, error: int) -> PjrtError:
        """The :class:`PjrtError` of a returned ``PJRT_Error*`` (which is destroyed)."""
        message = _ErrorMessage(error=error)
        self._function("Error_Message", _VOID_FN)(ctypes.byref(message))
        text = ctypes.string_at(message.message, message.message_size).decode(
            errors="replace") if message.message else "(no message)"
        code = _ErrorGetCode(error=error)
        failed = self._function("Error_GetCode", _ERROR_FN)(ctypes.byref(code))
        self._function("Error_Destroy", _VOID_FN)(ctypes.byref(_ErrorDestroy(error=error)))
        if failed:
            self._function("Error_Destroy", _VOID_FN)(ctypes.byref(_ErrorDestroy(error=failed)))
        return PjrtError(text, -1 if failed else code.code)

    def call(self, name: str, args: ctypes.Structure) -> None:
        """Calls ``PJRT_<name>`` with ``args`` (filled in place).

        Raises:
            PjrtError: the plugin returned an error.
        """
        error = self._function(name, _ERROR_FN)(ctypes.byref(args))
        if error:
            raise self._error(error)

    # -------------------------------------------------------------- objects

    @contextlib.contextmanager
    def topology(self, name: str, options: Mapping[str, Any]) -> Iterator[int]:
        """A topology description (``PJRT_TopologyDescription_Create``), destroyed on
        exit; ``options`` are the plugin's create options (e.g. ``target_config``)."""
        values = NamedValues(options)
        key = name.encode()
        args = _TopologyCreate(topology_name=key, topology_name_size=len(key),
                               create_options=values.pointer, num_options=values.count)
        self.call("TopologyDescription_Create", args)
        try:
            yield args.topology
        finally:
            self.call("TopologyDescription_Destroy", _TopologyDestroy(topology=args.topology))

    @contextlib.contextmanager
    def client(self, options: Mapping[str, Any]) -> Iterator[int]:
        """A client on this machine's devices (``PJRT_Client_Create``), destroyed on
        exit; ``options`` are the plugin's create options (``platform_name``, ...)."""
        values = NamedValues(options)
        args = _ClientCreate(create_options=values.pointer, num_options=values.count)
        self.call("Client_Create", args)
        try:
            yield args.client
        finally:
            self.call("Client_Destroy", _ClientDestroy(client=args.client))

    @contextlib.contextmanager
    def executable(self, handle: int) -> Iterator[int]:
        """Destroys a ``PJRT_Executable`` on exit."""
        try:
            yield handle
        finally:
            self.call("Executable_Destroy", _ExecutableDestroy(executable=handle))

    @contextlib.contextmanager
    def loaded_executable(self, handle: int) -> Iterator[int]:
        """Destroys a ``PJRT_LoadedExecutable`` on exit."""
        try:
            yield handle
        finally:
            self.call("LoadedExecutable_Destroy", _LoadedExecutableDestroy(executable=handle))

    # -------------------------------------------------------------- compiling

    def _compile(self, function: str, args_type: type, program: bytes, program_format: str,
                 compile_options: bytes, **target: int) -> int:
        """Runs one of the C API's compiles on ``program``; returns its executable."""
        with _program(program, program_format) as prog:
            args = args_type(program=ctypes.addressof(prog), compile_options=compile_options,
                             compile_options_size=len(compile_options), **target)
            self.call(function, args)
        return args.executable

    def compile_for_topology(self, topology: int, program: bytes, program_format: str,
                             compile_options: bytes) -> int:
        """Compiles without a client (``PJRT_Compile``); returns the new executable."""
        return self._compile("Compile", _Compile, program, program_format, compile_options,
                             topology=topology)

    def compile_on_client(self, client: int, program: bytes, program_format: str,
                          compile_options: bytes) -> int:
        """Compiles on a client (``PJRT_Client_Compile``); returns the loaded executable."""
        return self._compile("Client_Compile", _ClientCompile, program, program_format,
                             compile_options, client=client)

    def executable_of(self, loaded: int) -> int:
        """The ``PJRT_Executable`` of a loaded one (the caller destroys it)."""
        args = _LoadedExecutableGetExecutable(loaded_executable=loaded)
        self.call("LoadedExecutable_GetExecutable", args)
        return args.executable

    def optimized_program(self, executable: int) -> OptimizedProgram:
        """The executable's optimized program: asked for its size, then for its bytes."""
        prog = _Program(format=b"hlo", format_size=3)
        args = _ExecutableOptimizedProgram(executable=executable,
                                           program=ctypes.addressof(prog))
        self.call("Executable_OptimizedProgram", args)
        buffer = ctypes.create_string_buffer(prog.code_size)
        prog.code = ctypes.addressof(buffer)
        self.call("Executable_OptimizedProgram", args)
        fmt = (prog.format or b"")[:prog.format_size].decode()  # the plugin's own string
        return OptimizedProgram(buffer.raw[:prog.code_size], fmt)

    def serialize(self, executable: int) -> bytes:
        """The executable's serialization (``PJRT_Executable_Serialize``), copied out
        before the plugin's buffer is freed with its deleter."""
        args = _ExecutableSerialize(executable=executable)
        self.call("Executable_Serialize", args)
        try:
            return ctypes.string_at(args.serialized_bytes, args.serialized_bytes_size)
        finally:
            if args.serialized_executable_deleter:
                args.serialized_executable_deleter(args.serialized_executable)


def _varint(data: bytes, at: int) -> tuple[int, int]:
    """The protobuf varint at ``data[at:]`` and the offset after it."""
    value = shift = 0
    while True:
        byte = data[at]
        at += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, at


def proto_field(data: bytes, number: int) -> bytes | None:
    """The last value of length-delimited field ``number`` of a serialized protobuf
    message (None if absent): enough to unwrap a message without its schema.

    Raises:
        ValueError: the bytes are not a protobuf message.
    """
    found, at = None, 0
    try:
        while at < len(data):
            key, at = _varint(data, at)
            kind = key & 7
            if kind == 0:
                _, at = _varint(data, at)
            elif kind == 1:
                at += 8
            elif kind == 5:
                at += 4
            elif kind == 2:
                size, at = _varint(data, at)
                if key >> 3 == number:
                    found = data[at:at + size]
                at += size
            else:
                raise ValueError(f"unsupported protobuf wire type {kind}")
    except IndexError as err:
        raise ValueError("truncated protobuf message") from err
    if at != len(data):
        raise ValueError("truncated protobuf message")
    return found


def hlo_module_of(program: OptimizedProgram) -> bytes:
    """The serialized ``HloModuleProto`` of an optimized program: the code itself for
    format ``hlo``, its ``hlo_module`` field (1) for ``hlo_with_config`` (an
    ``HloModuleProtoWithConfig``, what XLA:GPU returns).

    Raises:
        PjrtError: another format, or no module in it.
    """
    if program.format == "hlo":
        return program.code
    module = proto_field(program.code, 1) if program.format == "hlo_with_config" else None
    if module is None:
        raise PjrtError(f"optimized program of format {program.format!r} holds no HLO module")
    return module


@contextlib.contextmanager
def _program(code: bytes, program_format: str) -> Iterator[_Program]:
    """A ``PJRT_Program`` over ``code``, valid inside the block (the buffers live here)."""
    buffer = ctypes.create_string_buffer(code, len(code))
    fmt = program_format.encode()
    yield _Program(code=ctypes.addressof(buffer), code_size=len(code), format=fmt,
                   format_size=len(fmt))


# ------------------------------------------------------------------ whole jobs


def deviceless_optimized_program(plugin: Plugin, module_proto: bytes, compile_options: bytes,
                                 topology_options: Mapping[str, Any],
                                 topology_name: str = "1x1x1") -> OptimizedProgram:
    """Compiles a serialized ``HloModuleProto`` for a described topology, no device
    needed, and returns the optimized program.

    Args:
        plugin: the loaded plugin.
        module_proto: the module (program format ``hlo``).
        compile_options: a serialized ``CompileOptionsProto``.
        topology_options: the topology's create options (XLA:GPU: ``target_config``, a
            ``GpuTargetConfigProto`` text, and ``topology``, e.g. ``"1x1x1"``).
        topology_name: the topology's name argument.

    Raises:
        PjrtError: the plugin rejected the topology or the module.
    """
    with plugin.topology(topology_name, topology_options) as topology:
        handle = plugin.compile_for_topology(topology, module_proto, "hlo", compile_options)
        with plugin.executable(handle) as executable:
            return plugin.optimized_program(executable)


def client_serialized_executable(plugin: Plugin, module_proto: bytes, compile_options: bytes,
                                 client_options: Mapping[str, Any]) -> bytes:
    """Compiles a serialized ``HloModuleProto`` on this machine's devices and returns the
    plugin's serialized executable (what ``PJRT_Executable_DeserializeAndLoad`` reads).

    Args:
        plugin: the loaded plugin.
        module_proto: the module (program format ``hlo``).
        compile_options: a serialized ``CompileOptionsProto``.
        client_options: the client's create options (XLA:GPU: ``platform_name``,
            ``preallocate``, ``memory_fraction``, ...).

    Raises:
        PjrtError: no device, or the plugin rejected the module.
    """
    with plugin.client(client_options) as client:
        loaded = plugin.compile_on_client(client, module_proto, "hlo", compile_options)
        with plugin.loaded_executable(loaded):
            with plugin.executable(plugin.executable_of(loaded)) as executable:
                return plugin.serialize(executable)
