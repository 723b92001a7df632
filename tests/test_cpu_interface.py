"""The CPU kernels' interface, which C and Python each state by hand: cpu_kernels.h declares every
function cpu_kernels.c and cpu_decode.c export, cpu_kernels.EXPORTS gives each the ctypes signature
the header declares, and cpu_decode.py's ctypes structs are laid out as the C compiler lays out the
header's (a mismatch turns the C decode block off with a notice, never runs it)."""
import ctypes
import re

import pytest
import torch

from kstep.layers import cpu_build, cpu_decode, cpu_kernels

needs_kernels = pytest.mark.skipif(not cpu_kernels.available(),
                                   reason="kstep's CPU kernels are off here (no AVX2/FMA, no C compiler, "
                                   "a failed build or KSTEP_CPU_KERNELS=0)")

# A top-level function: at the start of a line, a return type, a name, a parameter list without
# parentheses (none of these take function pointers), then a body or a semicolon.
FUNCTION = re.compile(r"^(?P<head>[A-Za-z_][\w \t*]*?)\b(?P<name>\w+)\s*\((?P<params>[^()]*)\)\s*(?P<end>[{;])", re.M)
CTYPES = {"long": ctypes.c_long, "int": ctypes.c_int, "float": ctypes.c_float, "void": None}


def functions(path, end: str) -> dict[str, tuple[str, str]]:
    """{name: (return type, parameters)} of the non-static functions defined (end "{") or declared
    (end ";") at the top level of a C file."""
    text = re.sub(r"//[^\n]*|/\*.*?\*/", "", path.read_text(), flags=re.S)
    return {m["name"]: (m["head"].strip(), m["params"]) for m in FUNCTION.finditer(text)
            if m["end"] == end and not m["head"].split()[0] in ("static", "typedef", "return")}


def ctype(declaration: str):
    """The ctypes type a C parameter or return type passes as: any pointer as c_void_p."""
    if "*" in declaration:
        return ctypes.c_void_p
    words = declaration.replace("const", "").split()
    return CTYPES[words[0]]


def test_the_header_declares_every_export_with_the_ctypes_signature():
    defined = {}
    for source in cpu_build.SOURCES:
        defined.update(functions(source, "{"))
    declared = functions(cpu_build.HEADER, ";")
    assert len(defined) == 11 and "kstep_argmax_rows" in defined  # the parse finds them
    assert set(defined) == set(declared), "declare each export in cpu_kernels.h (and define each declared one)"
    assert set(cpu_kernels.EXPORTS) == set(declared), "give each export its ctypes signature in EXPORTS"
    for name, (result, params) in declared.items():
        argtypes, restype = cpu_kernels.EXPORTS[name]
        assert ctype(result) is restype, name
        assert [ctype(p) for p in params.split(",")] == argtypes, name
        assert defined[name][0] == result  # the compiler checks the parameters (the header is included)


def test_the_parse_sees_static_and_multiline_definitions(tmp_path):
    src = tmp_path / "x.c"
    src.write_text("static inline float hidden(float a) { return a; }\n// void commented(int a) {\n"
                   "long shown(const float *x,\n           long n) {\n    if (n) {\n        return 1;\n    }\n}\n")
    assert functions(src, "{") == {"shown": ("long", "const float *x,\n           long n")}


@needs_kernels
def test_the_ctypes_structs_are_laid_out_as_the_c_ones(capsys, monkeypatch):
    lib = cpu_kernels.library()
    assert cpu_decode.layout_mismatch(lib) is None

    class Proj(ctypes.Structure):  # `out` an int: the same size and offsets (padding), another field size
        _fields_ = [(name, ctypes.c_int if name == "out" else kind) for name, kind in cpu_decode._Proj._fields_]

    class Layer(ctypes.Structure):  # the proj array missing
        _fields_ = cpu_decode._Layer._fields_[:-1]
    assert cpu_decode.layout_mismatch(lib, proj=Proj) == \
        "Proj.out's size is 8 in cpu_kernels.h's struct, 4 in cpu_decode.py's ctypes mirror"
    assert "sizeof(Layer) is 376" in cpu_decode.layout_mismatch(lib, layer=Layer)

    # a mismatch at first use: the torch block runs, after one notice
    monkeypatch.setattr(cpu_decode, "_Layer", Layer)
    monkeypatch.setattr(cpu_decode, "_layout_checked", None)
    capsys.readouterr()
    assert not cpu_decode._runs_in_c() and not cpu_decode._runs_in_c()
    err = capsys.readouterr().err
    assert err.count("kstep: its C decode block is off") == 1 and "sizeof(Layer)" in err, err
    from test_cpu_decode import empty_cache, random_model  # a block the C would otherwise take
    model = random_model()
    with torch.inference_mode():
        segment = cpu_decode.Segment(0, 1, 1, cache=empty_cache(model), cache_start=3)
        assert cpu_decode.plan(model.layers[0], torch.randn(1, 768), [segment], 0, None) is None
