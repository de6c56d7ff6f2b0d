"""The store's underscore names stay inside the store's modules (data/store.py, files.py, leases.py).

Other packages (and the tests, and the benchmarks) reach the store through public names: the
``Store``'s own, ``store.files`` (``StoreFiles``), ``data/leases.py``'s functions and ``data/store.py``'s
module functions. The underscore names are collected by introspection (the classes' members, an
instance's attributes, the modules' private globals), so a new one is covered without editing this test.
"""

import ast
import pathlib
import pickle

from hvd_spark._internal.data import files, leases, store
from hvd_spark._internal.data.files import StoreFiles
from hvd_spark._internal.data.store import Store

ROOT = pathlib.Path(__file__).resolve().parents[2]
STORE_MODULES = {ROOT / "hvd_spark" / "_internal" / "data" / f"{name}.py" for name in ("store", "files", "leases")}
STORE_MODULE_NAMES = {m.__name__ for m in (store, files, leases)}


def _private(names) -> set[str]:
    return {n for n in names if n.startswith("_") and not (n.startswith("__") and n.endswith("__"))}


def store_private_names(tmp_path) -> set[str]:
    """Every underscore name of the store's classes (members and an instance's attributes) and modules."""
    instance = Store(str(tmp_path))
    names = set()
    for cls in (Store, StoreFiles, leases.Lease, leases.LeaseHeldError, store.Checkpoint):
        for klass in cls.__mro__:
            if klass.__module__ in STORE_MODULE_NAMES:
                names |= _private(vars(klass))
    names |= _private(vars(instance)) | _private(vars(instance.files))
    for module in (store, files, leases):
        names |= _private(vars(module))
    return names


def private_uses(root: pathlib.Path, names: set[str], skip: set[pathlib.Path]) -> list[str]:
    """Where a file under ``root`` (but not in ``skip``) uses one of ``names``: as an attribute of
    anything but ``self`` / ``cls`` (``store._rm``, ``self.store._rm``, ``Store._rm``), as a name imported
    from a store module, or as a string (``getattr(store, "_rm")``, ``monkeypatch.setattr(S, "_rm", ...)``)."""
    out = []
    for path in sorted(root.rglob("*.py")):
        if path.resolve() in skip or ".venv" in path.parts:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Attribute) and node.attr in names:
                if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                    out.append(f"{path.relative_to(root.parent)}:{node.lineno}: .{node.attr}")
            elif isinstance(node, ast.ImportFrom) and node.module in STORE_MODULE_NAMES:
                out += [
                    f"{path.relative_to(root.parent)}:{node.lineno}: import {a.name}"
                    for a in node.names
                    if a.name in names
                ]
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names:
                out.append(f"{path.relative_to(root.parent)}:{node.lineno}: {node.value!r}")
    return out


def test_the_private_names_are_collected(tmp_path):
    names = store_private_names(tmp_path)
    # a sample of each kind: an instance's attribute, a method, a module's private global
    assert {"_retry_window", "_verified", "_run_in_use", "_window", "_set_aside", "_HELD_TOKENS"} <= names
    assert not {"files", "write_json", "lease", "job_config"} & names  # the public names


def test_no_package_uses_an_underscore_name_of_the_store(tmp_path):
    names = store_private_names(tmp_path)
    skip = STORE_MODULES | {pathlib.Path(__file__).resolve()}
    uses = [u for folder in ("hvd_spark", "tests", "benchmarks") for u in private_uses(ROOT / folder, names, skip)]
    assert uses == [], "use the store's public names (store.files, data/leases.py, data/store.py's functions):\n" + (
        "\n".join(uses)
    )


def test_a_store_pickles_with_its_files(tmp_path):
    """Stores travel pickled to the ranks and tasks: the copy has the same config and reaches the same files."""
    import pickle

    original = Store(str(tmp_path), retry_window=5)
    original.files.write_json(original.files.path("a.json"), {"x": 1})
    copy = pickle.loads(pickle.dumps(original))
    assert copy == original and copy.to_config() == original.to_config() and copy.retry_window == 5.0
    assert copy.files.read_json(copy.files.path("a.json")) == {"x": 1}


def test_a_store_pickled_before_the_split_gets_its_files_back(tmp_path):
    store = Store(str(tmp_path), retry_window=7)
    old = dict(store.__dict__)  # as the Store before data/files.py kept it: fsspec's parts on the store itself
    ops = old.pop("files")
    old.update(_fs=ops.fs, _root=ops.root, _protocol=ops.protocol)
    revived = Store.__new__(Store)
    revived.__setstate__(pickle.loads(pickle.dumps(old)))
    revived.files.write_json(revived.files.path("x.json"), {"a": 1})
    assert store.files.read_json(store.files.path("x.json")) == {"a": 1}
    assert revived.retry_window == 7 and not any(k in vars(revived) for k in ("_fs", "_root", "_protocol"))
