"""XLA:GPU through the PJRT C API (``hlo_tools.jax_bridge.pjrt``), compiled without a GPU.

Hand-written fusions reach XLA:GPU as written and, with its fusion passes off, stay as
written; XLA's refusals (an error, a crash of the compile process) come back as
``HloCompileError``. Skipped where the CUDA plugin or ``ptxas`` is not installed.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hlo_tools.jax_bridge import pjrt
from hlo_tools.jax_bridge.errors import HloCompileError
from hlo_tools.jax_bridge.pjrt import capi, driver, locate

REASON = pjrt.unavailable_reason()
if REASON is not None:
    pytest.skip(REASON, allow_module_level=True)

#: XLA:GPU's passes that create or merge fusions.
FUSION_OFF = {"xla_disable_hlo_passes": "priority-fusion,fusion"}

ONE_FUSION = """HloModule one_fusion

fused_body {
  a = f32[1024]{0} parameter(0)
  b = f32[1024]{0} parameter(1)
  s = f32[1024]{0} add(a, b)
  ROOT m = f32[1024]{0} multiply(s, b)
}

ENTRY main {
  p0 = f32[1024]{0} parameter(0)
  p1 = f32[1024]{0} parameter(1)
  ROOT f = f32[1024]{0} fusion(p0, p1), kind=kLoop, calls=fused_body
}
"""

TWO_FUSIONS = """HloModule two_fusions

fused_add {
  a = f32[1024]{0} parameter(0)
  b = f32[1024]{0} parameter(1)
  ROOT s = f32[1024]{0} add(a, b)
}

fused_multiply {
  x = f32[1024]{0} parameter(0)
  y = f32[1024]{0} parameter(1)
  ROOT m = f32[1024]{0} multiply(x, y)
}

ENTRY main {
  p0 = f32[1024]{0} parameter(0)
  p1 = f32[1024]{0} parameter(1)
  f1 = f32[1024]{0} fusion(p0, p1), kind=kLoop, calls=fused_add
  ROOT f2 = f32[1024]{0} fusion(f1, p1), kind=kLoop, calls=fused_multiply
}
"""

UNKNOWN_CUSTOM_CALL = """HloModule unknown_custom_call

ENTRY main {
  p0 = f32[1024]{0} parameter(0)
  ROOT c = f32[1024]{0} custom-call(p0), custom_call_target="disco_no_such_target"
}
"""

ALL_REDUCE = """HloModule all_reduce, replica_count=2

sum {
  x = f32[] parameter(0)
  y = f32[] parameter(1)
  ROOT s = f32[] add(x, y)
}

ENTRY main {
  p0 = f32[1024]{0} parameter(0)
  ROOT r = f32[1024]{0} all-reduce(p0), replica_groups={{0,1}}, to_apply=sum
}
"""

_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_OPCODE = re.compile(r"=\s*\S+\s+([a-z][\w\-]*)\(")
_FUSION_CALL = re.compile(r"\sfusion\(.*\bcalls=%?([\w.\-]+)")


def _computations(text: str) -> tuple[str, dict[str, list[str]]]:
    """The entry's name and each computation's instruction lines, of HLO text."""
    entry, current, found = "", None, {}
    for line in text.splitlines():
        header = _HEADER.match(line)
        if header and not line.startswith("HloModule"):
            current = header.group(2)
            found[current] = []
            entry = current if header.group(1) else entry
        elif line.startswith("}"):
            current = None
        elif current is not None:
            found[current].append(line)
    return entry, found


def _fusions(text: str) -> list[list[str]]:
    """The opcodes of each fusion the entry computation calls, in order."""
    entry, comps = _computations(text)
    called = [m.group(1) for line in comps[entry] if (m := _FUSION_CALL.search(line))]
    return [[op.group(1) for line in comps[name] if (op := _OPCODE.search(line))]
            for name in called]


def test_the_h100_description_is_a_gpu_target_config() -> None:
    text = pjrt.h100_target_config()
    assert "core_count: 132" in text and "device_memory_size: 84942979072" in text
    assert "cuda_compute_capability { major: 9 minor: 0 }" in text
    assert 'platform_name: "CUDA"' in text


def test_the_target_description_can_come_from_a_file(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "gpu.txtpb"
    path.write_text('platform_name: "CUDA"\n')
    monkeypatch.setenv(pjrt.TARGET_CONFIG_ENV, str(path))
    assert pjrt.target_config() == 'platform_name: "CUDA"\n'
    assert pjrt.target_config("given") == "given"
    monkeypatch.delenv(pjrt.TARGET_CONFIG_ENV)
    assert pjrt.target_config() == pjrt.h100_target_config()


def test_a_hand_written_fusion_compiles_as_written() -> None:
    out = pjrt.compile_deviceless(ONE_FUSION, FUSION_OFF)
    fusions = _fusions(out.optimized_text)
    assert len(fusions) == 1, out.optimized_text
    assert {"add", "multiply"} <= set(fusions[0]), out.optimized_text
    assert out.seconds > 0


def test_two_fusions_in_a_chain_stay_separate_with_fusion_passes_off() -> None:
    kept = _fusions(pjrt.compile_deviceless(TWO_FUSIONS, FUSION_OFF).optimized_text)
    assert len(kept) == 2, kept
    assert "add" in kept[0] and "multiply" not in kept[0]
    assert "multiply" in kept[1] and "add" not in kept[1]
    merged = _fusions(pjrt.compile_deviceless(TWO_FUSIONS).optimized_text)
    assert len(merged) == 1, merged  # XLA's own pipeline merges them: the check can fail


def test_an_all_reduce_compiles_for_two_gpus_of_one_host() -> None:
    text = pjrt.compile_deviceless(ALL_REDUCE, replicas=2).optimized_text
    assert "replica_groups={{0,1}}" in text  # all-reduce, or its async start/done pair


def test_xla_refusing_a_module_raises_its_message() -> None:
    with pytest.raises(HloCompileError, match="disco_no_such_target") as info:
        pjrt.compile_deviceless(UNKNOWN_CUSTOM_CALL)
    assert isinstance(info.value, pjrt.PjrtError) and info.value.code_name == "NOT_FOUND"


def test_text_xla_cannot_parse_fails_before_any_compile() -> None:
    with pytest.raises(HloCompileError, match="cannot parse"):
        pjrt.compile_deviceless("HloModule broken\n\nENTRY main {\n  ROOT x = f32[ nonsense\n}")


def test_a_crash_of_the_compile_process_is_an_error_not_a_crash() -> None:
    # XLA:GPU divides by the warp size: a zero kills the child with SIGFPE.
    broken = pjrt.h100_target_config().replace("threads_per_warp: 32", "threads_per_warp: 0")
    with pytest.raises(HloCompileError, match="ended without a result") as info:
        pjrt.compile_deviceless(ONE_FUSION, FUSION_OFF, target_config=broken)
    assert not isinstance(info.value, pjrt.PjrtError)


def test_a_compile_past_its_time_limit_is_an_error() -> None:
    with pytest.raises(HloCompileError, match="did not finish within"):
        pjrt.compile_deviceless(ONE_FUSION, FUSION_OFF, timeout_s=0.01)


def test_without_the_plugin_compiles_say_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(locate, "PLUGIN_MODULES", ("jax_plugins.disco_no_such_plugin",))
    monkeypatch.delenv(locate.PLUGIN_ENV, raising=False)
    assert pjrt.plugin_path() is None
    assert "no CUDA PJRT plugin" in pjrt.unavailable_reason()
    with pytest.raises(HloCompileError, match="no CUDA PJRT plugin"):
        pjrt.compile_deviceless(ONE_FUSION)


def test_a_crash_message_leads_with_xla_fatal_lines() -> None:
    stderr = ("I0000 starting\nF1128 08:00:00.0 1 gpu.cc:12] Check failed: x > 0 (0 vs. 0)\n"
              "*** Check failure stack trace: ***\n    @ 0x1234 xla::Foo()\n")
    message = driver.failure_message(-6, stderr, lines=2)
    lines = message.splitlines()
    assert "SIGABRT" in lines[0] and "Check failed: x > 0" in lines[1]
    assert lines[2:] == ["*** Check failure stack trace: ***", "    @ 0x1234 xla::Foo()"]
    assert "exit status 3" in driver.failure_message(3, "")


def test_the_compile_process_does_not_import_jax(tmp_path: Path) -> None:
    """The child runs on stand-ins of the packages above it: no jax, no second
    discovery of the plugin, a fast start; it answers an unknown request cleanly."""
    (tmp_path / "request.json").write_text(json.dumps({"mode": "nothing", "plugin": "",
                                                       "options": {}}))
    (tmp_path / "module.pb").write_bytes(b"")
    (tmp_path / "options.pb").write_bytes(b"")
    proc = subprocess.run([sys.executable, "-X", "importtime", "-c", driver.child_bootstrap(),
                           str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads((tmp_path / "result.json").read_text())["ok"] is False
    imported = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines()}
    assert "hlo_tools.jax_bridge.pjrt.capi" in imported and "jax" not in imported


def test_a_plugin_error_names_its_status_code() -> None:
    assert capi.PjrtError("x", 9).code_name == "FAILED_PRECONDITION"
    assert capi.PjrtError("x").code_name == "?"


def test_the_function_table_prefix_ends_at_pjrt_compile() -> None:
    """90 slots after a 40-byte head: PJRT_Compile is the table's 90th function in
    every C API version from 0.90 on (the table only grows at its end)."""
    assert capi._SLOTS.index("Compile") == len(capi._SLOTS) - 1 == 89
    assert ctypes.sizeof(capi._Api) == 40 + 90 * ctypes.sizeof(ctypes.c_void_p)


def test_protobuf_fields_unwrap_without_a_schema() -> None:
    message = b"\x0a\x03abc\x10\x05\x12\x02xy"  # field 1 "abc", field 2 varint 5, field 2 "xy"
    assert capi.proto_field(message, 1) == b"abc"
    assert capi.proto_field(message, 2) == b"xy"
    assert capi.proto_field(message, 3) is None
    with pytest.raises(ValueError):
        capi.proto_field(b"\x0a\x09abc", 1)


def _has_gpu() -> bool:
    return Path("/dev/nvidia0").exists()


def test_compiling_for_a_real_gpu() -> None:
    """With a GPU: the plugin's serialized executable; without one: a clean error."""
    options = pjrt.compile_options(FUSION_OFF)
    if _has_gpu():
        assert len(pjrt.compile_serialized(ONE_FUSION, options)) > 0
    else:
        with pytest.raises(HloCompileError, match="(?i)gpu"):
            pjrt.compile_serialized(ONE_FUSION, options)


def test_a_gpu_compile_preloads_the_cuda_libraries_it_can(tmp_path: Path) -> None:
    """The client child loads the nvidia wheels' libraries before the plugin (jax's plugin
    package does so when jax starts; the child leaves jax unimported): what loads is
    loaded globally, what cannot (a broken file) is left to the library path."""
    from hlo_tools.jax_bridge.pjrt import child

    broken = tmp_path / "libbroken.so.1"
    broken.write_bytes(b"not a library")
    libm = ctypes.util.find_library("m")
    assert libm
    child.preload([str(broken), libm])  # no exception: libm loads, the broken one is left
    assert all(Path(p).is_file() for p in locate.cuda_libraries())


def test_the_plugin_can_be_named_by_its_file(monkeypatch: pytest.MonkeyPatch,
                                              tmp_path: Path) -> None:
    """``$DISCO_PJRT_PLUGIN`` names the plugin (a wheel unpacked where jax does not look
    for plugins); a name that is no file says so."""
    found = pjrt.plugin_path()
    monkeypatch.setenv(locate.PLUGIN_ENV, found)
    assert pjrt.plugin_path() == found
    monkeypatch.setenv(locate.PLUGIN_ENV, str(tmp_path / "missing.so"))
    assert pjrt.plugin_path() is None
    assert "DISCO_PJRT_PLUGIN names no file" in pjrt.unavailable_reason()
