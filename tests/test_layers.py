"""The layers of csrc/ depend only downward (README "Design"). CMake checks calls (each layer links on
its own with only the layers below it); this checks includes, which a header-only use would slip past."""
import re
from pathlib import Path

CSRC = Path(__file__).resolve().parents[1] / "csrc"

BELOW = {
    "common": {"common"},
    "cuda": {"common", "cuda"},
    "nn": {"common", "cuda", "nn"},
    "distributed": {"common", "cuda", "distributed"},
    "train": {"common", "cuda", "nn", "distributed", "train"},
    "bindings": {"common", "cuda", "nn", "distributed", "train", "bindings"},
}


def includes(path):
    return re.findall(r'^#include "([^"]+)"', path.read_text(), re.M)


def test_every_layer_includes_only_itself_and_the_layers_below():
    wrong = []
    for layer, allowed in BELOW.items():
        for p in sorted((CSRC / layer).rglob("*")):
            if p.suffix not in (".h", ".cpp", ".cu"):
                continue
            wrong += [f"{p.relative_to(CSRC)} includes {inc}" for inc in includes(p)
                      if inc.split("/")[0] not in allowed]
    assert wrong == []


def test_algorithms_see_the_transport_interface_not_a_transport():
    wrong = []
    for p in sorted((CSRC / "distributed" / "algorithms").glob("*")):
        for inc in includes(p):
            if inc.startswith("distributed/") and not inc.startswith("distributed/algorithms/") and \
                    inc not in ("distributed/transport/transport.h", "distributed/types.h",
                                "distributed/reduce_probe.h"):  # plain data, as types.h
                wrong.append(f"{p.name} includes {inc}")
    assert wrong == []


def test_the_store_knows_nothing_of_the_transports_or_backends():
    wrong = [f"{p.name} includes {inc}" for p in sorted((CSRC / "distributed" / "store").glob("*"))
             for inc in includes(p) if inc.startswith(("distributed/transport/", "distributed/backend/"))]
    assert wrong == []


# Note [Build time] (csrc/CMakeLists.txt): the files of each layer but cuda, and the bindings, compile as unity
# batches, several .cpp files in one translation unit. Two files each defining a file-local name is then a
# compile error where the two are variables or types, but two file-local *functions* of one name become
# overloads of each other: a call in one file can silently pick the other file's function. And a
# using-directive or a macro at file scope reaches the files after it in the batch.
UNITY = ("common", "nn", "distributed", "train", "bindings")


def _strip(text):
    text = re.sub(r"/\*.*?\*/", "", re.sub(r"//[^\n]*", "", text), flags=re.S)
    return re.sub(r'"(\\.|[^"\\\n])*"', '""', text)


def _top_level(body):
    """The text of `body` outside any braces, in pieces cut at each brace block."""
    depth, out, cur = 0, [], []
    for ch in body:
        if ch == "{":
            if depth == 0:
                out.append("".join(cur))
                cur = []
            depth += 1
        elif ch == "}":
            depth -= 1
        elif depth == 0:
            cur.append(ch)
    return out + ["".join(cur)]


def file_local_functions(text):
    """Names of the functions a .cpp defines in an anonymous namespace or as `static` at namespace scope."""
    text, names = _strip(text), set()
    for m in re.finditer(r"namespace\s*\{", text):
        depth, i = 0, m.end() - 1
        while i < len(text):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                break
            i += 1
        for piece in _top_level(text[m.end():i]):
            decl = piece.split(";")[-1]   # the declaration that the next brace block is the body of
            f = re.search(r"\b([A-Za-z_]\w*)\s*\([^()]*(\([^()]*\)[^()]*)*\)\s*(const\s*)?(noexcept\s*)?$", decl.strip())
            if f and not re.search(r"\b(struct|class|enum|union|namespace)\b|=", decl):
                names.add(f.group(1))
    names |= set(re.findall(r"^static\s+(?:inline\s+)?[\w:<>,\s\*&]+?\b([A-Za-z_]\w*)\s*\(", text, re.M))
    return names


def compiled_alone():
    """The files CMakeLists.txt keeps out of the unity batches (SKIP_UNITY_BUILD_INCLUSION)."""
    cm = (CSRC / "CMakeLists.txt").read_text()
    m = re.search(r"set_source_files_properties\((.*?)PROPERTIES SKIP_UNITY_BUILD_INCLUSION ON", cm, re.S)
    return set(re.findall(r"csrc/([\w/]+\.cpp)", m.group(1))) if m else set()


def test_files_of_one_unity_batch_do_not_define_the_same_file_local_function():
    alone, wrong = compiled_alone(), []
    for layer in UNITY:
        seen = {}
        for p in sorted((CSRC / layer).rglob("*.cpp")):
            rel = str(p.relative_to(CSRC))
            if rel in alone:
                continue
            for name in file_local_functions(p.read_text()):
                if name in seen:
                    wrong.append(f"{name}: {seen[name]} and {rel}")
                seen.setdefault(name, rel)
    assert wrong == []


def test_no_file_of_a_unity_batch_leaks_a_using_directive_or_a_macro():
    alone, wrong = compiled_alone(), []
    for layer in UNITY[:-1]:   # the bindings' using-directives are all of cx namespaces, in cx::bindings
        for p in sorted((CSRC / layer).rglob("*.cpp")):
            rel = str(p.relative_to(CSRC))
            if rel in alone:
                continue
            text = _strip(p.read_text())
            defined = re.findall(r"^\s*#\s*define\s+(\w+)", text, re.M)
            undefined = set(re.findall(r"^\s*#\s*undef\s+(\w+)", text, re.M))
            wrong += [f"{rel} defines {d} and never #undefs it" for d in defined if d not in undefined]
            wrong += [f"{rel}: using namespace {u}" for u in re.findall(r"using\s+namespace\s+([\w:]+)", text)]
    assert wrong == []


def test_the_file_local_function_check_sees_what_it_must():
    text = """namespace cx {\nnamespace {\nsize_t checked(const char* w, int64_t v) {\n  return v;\n}\n"""\
           """int kX = 3;\nstruct S { int f() { return 1; } };\n}  // namespace\nstatic bool helper(int a) { return a; }\n}"""
    assert file_local_functions(text) == {"checked", "helper"}
