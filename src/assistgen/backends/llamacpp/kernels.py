"""The kernel check: does each matmul kernel of the loaded ggml give a row the bits of the one-row pass?

Contract: `check_rows(cases, max_rows)` multiplies, for each `Case` (a ggml type and a row length), a weight matrix
of that type by n activation rows, n = 1..max_rows, on the CPU backend of the llama.cpp libraries llama-cpp-python
loads, with the weight in every buffer type a model's weight of that shape would get (ggml's repacked
`CPU_REPACK` layout where it takes the type, the plain `CPU` one always), with the row-exact switch on (and, asked,
off), and returns one `RowCheck` per (case, buffer type, switch): the first row count whose rows are not bitwise the
one-row pass's (None: all are) and the largest difference. Weights are random values quantized by ggml itself
(`ggml_quantize_chunk`), activations random floats, both from a fixed seed. `model_cases(path)` gives the cases of
a GGUF file (each matmul weight's type and row length). `kernel_families()` names what ggml's CPU backend uses here:
its extra buffer types (AMX, CPU_REPACK) and the instruction sets it was built for and found.

It talks to ggml through its C API (ctypes), never to llama.cpp: it reads no model file's data.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

import numpy as np

GGML_TYPES = {0: "f32", 1: "f16", 2: "q4_0", 3: "q4_1", 6: "q5_0", 7: "q5_1", 8: "q8_0", 10: "q2_K", 11: "q3_K",
              12: "q4_K", 13: "q5_K", 14: "q6_K", 20: "iq4_nl", 23: "iq4_xs", 30: "bf16"}
_CPU_DEVICE = 0  # GGML_BACKEND_DEVICE_TYPE_CPU
_TENSOR_BUFFER_OFFSET = 8  # struct ggml_tensor { enum ggml_type type; struct ggml_backend_buffer * buffer; ...}


@dataclass(frozen=True)
class Case:
    """One matmul shape: a weight of `ggml_type` with rows of `row_length` values (and `out_rows` rows)."""

    ggml_type: int
    row_length: int
    out_rows: int = 64

    @property
    def name(self) -> str:
        return f"{GGML_TYPES.get(self.ggml_type, self.ggml_type)}[{self.row_length}]"


@dataclass(frozen=True)
class RowCheck:
    """What the check found for one case in one buffer type with the switch on (`row_exact_switch`) or off."""

    case: Case
    buffer_type: str  # "CPU" or an extra buffer type's name ("CPU_REPACK", "AMX")
    row_exact_switch: bool
    first_differing_rows: int | None  # the smallest n whose rows are not bitwise the one-row pass's; None: none
    largest_difference: float

    @property
    def exact(self) -> bool:
        return self.first_differing_rows is None


class _InitParams(ctypes.Structure):
    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p), ("no_alloc", ctypes.c_bool)]


def _api(lib_dir: Path):
    """ggml's C functions the check calls, typed (from the libraries in `lib_dir`: libggml-base, libggml)."""
    base = ctypes.CDLL(str(lib_dir / "libggml-base.so"))
    ggml = ctypes.CDLL(str(lib_dir / "libggml.so"))
    p, sz, i64, i32 = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int64, ctypes.c_int
    sig = {
        (base, "ggml_init"): ([_InitParams], p), (base, "ggml_free"): ([p], None),
        (base, "ggml_new_tensor_2d"): ([p, i32, i64, i64], p), (base, "ggml_mul_mat"): ([p, p, p], p),
        (base, "ggml_new_graph"): ([p], p), (base, "ggml_build_forward_expand"): ([p, p], None),
        (base, "ggml_row_size"): ([i32, i64], sz), (base, "ggml_nbytes"): ([p], sz),
        (base, "ggml_quantize_chunk"): ([i32, p, p, i64, i64, i64, p], sz),
        (base, "ggml_backend_alloc_ctx_tensors_from_buft"): ([p, p], p),
        (base, "ggml_backend_buft_alloc_buffer"): ([p, sz], p), (base, "ggml_backend_buffer_free"): ([p], None),
        (base, "ggml_backend_buft_name"): ([p], ctypes.c_char_p),
        (base, "ggml_backend_tensor_set"): ([p, p, sz, sz], None),
        (base, "ggml_backend_tensor_get"): ([p, p, sz, sz], None),
        (base, "ggml_backend_graph_compute"): ([p, p], i32), (base, "ggml_backend_free"): ([p], None),
        (base, "ggml_backend_dev_init"): ([p, ctypes.c_char_p], p),
        (base, "ggml_backend_dev_buffer_type"): ([p], p), (base, "ggml_backend_dev_backend_reg"): ([p], p),
        (base, "ggml_backend_dev_supports_op"): ([p, p], ctypes.c_bool),
        (base, "ggml_backend_reg_get_proc_address"): ([p, ctypes.c_char_p], p),
        (ggml, "ggml_backend_dev_by_type"): ([i32], p),
    }
    api = {}
    for (library, name), (args, result) in sig.items():
        fn = getattr(library, name)
        fn.argtypes, fn.restype = args, result
        api[name] = fn
    return api


class _Cpu:
    """ggml's CPU device and a backend on it, with its buffer types and the row-exact switch."""

    def __init__(self, lib_dir: Path, threads: int):
        load_backends(lib_dir)
        self.api = api = _api(lib_dir)
        self.device = api["ggml_backend_dev_by_type"](_CPU_DEVICE)
        if not self.device:
            raise RuntimeError("ggml has no CPU device")
        self.backend = api["ggml_backend_dev_init"](self.device, None)
        cpu_proc("ggml_backend_set_n_threads", None, ctypes.c_void_p, ctypes.c_int, lib_dir=lib_dir)(self.backend,
                                                                                                     threads)
        self.switch = row_exact_switch(lib_dir)
        extra = cpu_proc("ggml_backend_dev_get_extra_bufts", ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p,
                         lib_dir=lib_dir)
        self.extra: list[int] = []
        if extra is not None:
            array = extra(self.device)
            i = 0
            while array and array[i]:
                self.extra.append(array[i])
                i += 1
        self.plain = api["ggml_backend_dev_buffer_type"](self.device)

    def name(self, buft: int) -> str:
        return self.api["ggml_backend_buft_name"](buft).decode()

    def close(self) -> None:
        self.api["ggml_backend_free"](self.backend)


def row_exact_switch(lib_dir: Path | None = None):
    """The patch's `ggml_cpu_assistgen_row_exact(bool)` of the CPU backend loaded (typed): it turns ggml's row-exact
    CPU kernels on or off for the passes that follow; None on a build without the patch."""
    lib_dir = lib_dir or library_dir()
    switch = cpu_proc("ggml_cpu_assistgen_row_exact", None, ctypes.c_bool, lib_dir=lib_dir)
    if switch is None:  # builds of the patch before 0.3.36.3 export it from libggml-cpu only
        try:
            switch = ctypes.CDLL(str(lib_dir / "libggml-cpu.so")).ggml_cpu_assistgen_row_exact
        except (OSError, AttributeError):
            return None
        switch.argtypes, switch.restype = [ctypes.c_bool], None
    return switch


def _context(api, mb: int = 4):
    ctx = api["ggml_init"](_InitParams(mb << 20, None, True))
    if not ctx:
        raise RuntimeError("ggml_init failed")
    return ctx


def _quantized(api, case: Case, rng: np.random.Generator) -> ctypes.Array:
    values = rng.standard_normal((case.out_rows, case.row_length)).astype(np.float32)
    size = api["ggml_row_size"](case.ggml_type, case.row_length) * case.out_rows
    out = (ctypes.c_char * size)()
    api["ggml_quantize_chunk"](case.ggml_type, values.ctypes.data, out, 0, case.out_rows, case.row_length, None)
    return out


class _Weight:
    """A weight tensor of one case placed in one buffer type (repacked there when the type repacks)."""

    def __init__(self, cpu: _Cpu, case: Case, buft: int, data: ctypes.Array):
        api = cpu.api
        self.api, self.ctx = api, _context(api, 1)
        self.tensor = api["ggml_new_tensor_2d"](self.ctx, case.ggml_type, case.row_length, case.out_rows)
        self.buffer = api["ggml_backend_alloc_ctx_tensors_from_buft"](self.ctx, buft)
        if not self.buffer:
            api["ggml_free"](self.ctx)
            raise RuntimeError(f"could not allocate {case.name} in {cpu.name(buft)}")
        api["ggml_backend_tensor_set"](self.tensor, data, 0, api["ggml_nbytes"](self.tensor))

    def close(self) -> None:
        self.api["ggml_backend_buffer_free"](self.buffer)
        self.api["ggml_free"](self.ctx)


def _takes(cpu: _Cpu, case: Case, buft: int) -> bool:
    """Whether ggml's CPU device would multiply a weight of this case held in `buft` (as llama.cpp asks it when it
    places a model's weights: the weight's buffer set to an empty one of that type, then `supports_op`)."""
    api = cpu.api
    ctx = _context(api, 1)
    try:
        weight = api["ggml_new_tensor_2d"](ctx, case.ggml_type, case.row_length, case.out_rows)
        rows = api["ggml_new_tensor_2d"](ctx, 0, case.row_length, 8)
        product = api["ggml_mul_mat"](ctx, weight, rows)
        empty = api["ggml_backend_buft_alloc_buffer"](buft, 0)
        slot = ctypes.c_void_p.from_address(weight + _TENSOR_BUFFER_OFFSET)
        slot.value = empty
        try:
            return bool(api["ggml_backend_dev_supports_op"](cpu.device, product))
        finally:
            slot.value = None
            api["ggml_backend_buffer_free"](empty)
    finally:
        api["ggml_free"](ctx)


def _multiply(cpu: _Cpu, weight: _Weight, case: Case, rows: np.ndarray) -> np.ndarray:
    """weight @ rows.T on the CPU backend: rows [n, row_length] float32 -> [n, out_rows] float32."""
    api = cpu.api
    ctx = _context(api)
    try:
        x = api["ggml_new_tensor_2d"](ctx, 0, case.row_length, rows.shape[0])
        product = api["ggml_mul_mat"](ctx, weight.tensor, x)
        graph = api["ggml_new_graph"](ctx)
        api["ggml_build_forward_expand"](graph, product)
        buffer = api["ggml_backend_alloc_ctx_tensors_from_buft"](ctx, cpu.plain)
        if not buffer:
            raise RuntimeError(f"could not allocate {rows.shape[0]} rows of {case.name}")
        try:
            data = np.ascontiguousarray(rows, dtype=np.float32)
            api["ggml_backend_tensor_set"](x, data.ctypes.data, 0, data.nbytes)
            if api["ggml_backend_graph_compute"](cpu.backend, graph) != 0:
                raise RuntimeError(f"ggml could not compute {case.name}")
            out = np.empty((rows.shape[0], case.out_rows), dtype=np.float32)
            api["ggml_backend_tensor_get"](product, out.ctypes.data, 0, out.nbytes)
            return out
        finally:
            api["ggml_backend_buffer_free"](buffer)
    finally:
        api["ggml_free"](ctx)


def _first_differing(cpu: _Cpu, weight: _Weight, case: Case, rows: np.ndarray) -> tuple[int | None, float]:
    alone = np.concatenate([_multiply(cpu, weight, case, rows[j:j + 1]) for j in range(len(rows))])
    first, worst = None, 0.0
    for n in range(2, len(rows) + 1):
        together = _multiply(cpu, weight, case, rows[:n])
        differ = together.view(np.uint32) != alone[:n].view(np.uint32)
        if differ.any():
            worst = max(worst, float(np.abs(together - alone[:n]).max()))
            first = n if first is None else first
    return first, worst


def check_rows(cases: list[Case], max_rows: int = 64, threads: int = 2, switch_states: tuple[bool, ...] = (True,),
               lib_dir: Path | None = None, seed: int = 0) -> list[RowCheck]:
    """One RowCheck per (case, buffer type that takes it, switch state); see the module's contract."""
    cpu = _Cpu(lib_dir or library_dir(), threads)
    if cpu.switch is None and any(switch_states):
        raise RuntimeError("this llama.cpp build has no row-exact switch (a stock build)")
    rng = np.random.default_rng(seed)
    found = []
    try:
        for case in cases:
            data = _quantized(cpu.api, case, rng)
            rows = rng.standard_normal((max_rows, case.row_length)).astype(np.float32)
            for buft in [*(b for b in cpu.extra if _takes(cpu, case, b)), cpu.plain]:
                weight = _Weight(cpu, case, buft, data)
                try:
                    for on in switch_states:
                        if cpu.switch is not None:
                            cpu.switch(on)
                        first, worst = _first_differing(cpu, weight, case, rows)
                        found.append(RowCheck(case, cpu.name(buft), on, first, worst))
                finally:
                    weight.close()
    finally:
        if cpu.switch is not None:
            cpu.switch(True)
        cpu.close()
    return found


def model_cases(path: Path, out_rows: int = 64) -> list[Case]:
    """The distinct (type, row length) of a GGUF file's matmul weights (2-D tensors other than the token
    embedding, whose rows are looked up; a tied output head is the embedding, so it is kept when no `output.weight`
    exists)."""
    from assistgen.backends.llamacpp.gguf import tensor_infos

    infos, _ = tensor_infos(path)
    tied = "output.weight" not in infos
    cases = set()
    for name, info in infos.items():
        if len(info.shape) != 2 or (name == "token_embd.weight" and not tied):
            continue
        cases.add(Case(info.ggml_type, info.shape[0], out_rows))
    return sorted(cases, key=lambda c: (c.ggml_type, c.row_length))


def library_dir() -> Path:
    """The folder of the llama.cpp libraries llama-cpp-python loads (`$LLAMA_CPP_LIB_PATH`, else its package's
    `lib`), found without loading them."""
    import importlib.util
    import os

    if os.environ.get("LLAMA_CPP_LIB_PATH"):
        return Path(os.environ["LLAMA_CPP_LIB_PATH"]).resolve()
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("llama-cpp-python is not installed")
    return Path(next(iter(spec.submodule_search_locations))).resolve() / "lib"


def library_identity(path: Path) -> str:
    """The llama.cpp libraries loaded, by path, size and modification time: a rebuilt library is measured again."""
    parts = []
    for lib in sorted(path.resolve().parent.glob("lib*.so*")):
        if lib.is_file() and not lib.is_symlink():
            stat = lib.stat()
            parts.append(f"{lib.name}:{stat.st_size}:{int(stat.st_mtime)}")
    return f"{path.resolve()}|{','.join(parts)}"


def cpu_variants(lib_dir: Path) -> list[Path]:
    """A portable build's CPU libraries, one per instruction-set level (`libggml-cpu-<level>.so`, ggml's
    `GGML_CPU_ALL_VARIANTS` with `GGML_BACKEND_DL`); empty for a build with one CPU library linked in."""
    return sorted(lib_dir.glob("libggml-cpu-*.so"))


_LOADED: dict[Path, str] = {}  # {libraries' folder: the CPU library loaded from it}


def load_backends(lib_dir: Path | None = None) -> str | None:
    """On a portable build, load the CPU library for this CPU once per process: the one ggml scores best for the CPU's
    features (it never loads one that needs an instruction the CPU lacks), or the one `$ASSISTGEN_GGML_CPU` names
    (`haswell`, `skylakex`, ...: for tests and measurements). Returns the variant loaded (None: not a portable
    build)."""
    import os

    lib_dir = lib_dir or library_dir()
    variants = cpu_variants(lib_dir)
    if not variants:
        return None
    if lib_dir in _LOADED:
        return _LOADED[lib_dir]
    ggml = ctypes.CDLL(str(lib_dir / "libggml.so"))
    forced = os.environ.get("ASSISTGEN_GGML_CPU")
    if forced:
        path = lib_dir / f"libggml-cpu-{forced}.so"
        if path not in variants:
            names = ", ".join(v.name.removeprefix("libggml-cpu-").removesuffix(".so") for v in variants)
            raise RuntimeError(f"ASSISTGEN_GGML_CPU={forced}: no such CPU library in {lib_dir} (there are: {names})")
        ggml.ggml_backend_load.argtypes, ggml.ggml_backend_load.restype = [ctypes.c_char_p], ctypes.c_void_p
        if not ggml.ggml_backend_load(str(path).encode()):
            raise RuntimeError(f"ggml could not load {path} on this CPU (ASSISTGEN_GGML_CPU={forced})")
        _LOADED[lib_dir] = forced
    else:
        ggml.ggml_backend_load_all_from_path.argtypes = [ctypes.c_char_p]
        ggml.ggml_backend_load_all_from_path(str(lib_dir).encode())
        _LOADED[lib_dir] = mapped_variant(lib_dir) or "best"
    return _LOADED[lib_dir]


def mapped_variant(lib_dir: Path) -> str | None:
    """Which of a portable build's CPU libraries this process has loaded (from /proc/self/maps; None elsewhere)."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = Path(line.split()[-1]) if "libggml-cpu-" in line else None
                if path is not None and path.parent == lib_dir:
                    return path.name.removeprefix("libggml-cpu-").removesuffix(".so")
    except OSError:
        pass
    return None


def cpu_proc(name: str, restype, *argtypes, lib_dir: Path | None = None):
    """A function the CPU backend exports through ggml's registry (e.g. `ggml_cpu_assistgen_row_exact`), typed; None
    where the backend does not have it."""
    lib_dir = lib_dir or library_dir()
    load_backends(lib_dir)
    api = _api(lib_dir)
    device = api["ggml_backend_dev_by_type"](_CPU_DEVICE)
    if not device:
        return None
    address = api["ggml_backend_reg_get_proc_address"](api["ggml_backend_dev_backend_reg"](device), name.encode())
    return ctypes.CFUNCTYPE(restype, *argtypes)(address) if address else None


def kernel_families(system_info: str, extra: list[str]) -> dict[str, bool]:
    """{family: in use} for the x86 kernel families: AMX (its extra buffer type registered), AVX-512 and AVX2 (the
    CPU backend built for them, from `llama_print_system_info`'s CPU line)."""
    flags = {part.split("=")[0].strip(): part.split("=")[-1].strip() == "1" for part in system_info.split("|")}
    return {"AMX": "AMX" in extra, "AVX-512": bool(flags.get("AVX512")), "AVX2": bool(flags.get("AVX2"))}


def extra_buffer_types(lib_dir: Path | None = None) -> list[str]:
    """The names of the extra buffer types ggml's CPU device offers for weights here (e.g. CPU_REPACK, AMX)."""
    cpu = _Cpu(lib_dir or library_dir(), 1)
    try:
        return [cpu.name(b) for b in cpu.extra]
    finally:
        cpu.close()
