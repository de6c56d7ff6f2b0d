"""Plain descriptions of a model's inputs and outputs and of the columns that feed them.

Pure functions (no Spark, no TensorFlow): the checks of column shapes against the model,
the assignment of Parquet files to ranks, and steps per epoch.
"""

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace


@dataclass(frozen=True)
class TensorSpec:
    """One model input or output: its shape without the batch axis, and dtype name."""

    name: str
    shape: tuple[int | None, ...]
    dtype: str
    key: str | None = None  # the model's dict key for this tensor, when it takes / returns a dict
    class_axis: int = -1  # an output's class axis (after the batch axis): Keras' last, torch's first
    ignore_index: int | None = None  # a class-index label marking a position without a label (the loss's)

    @property
    def elements(self) -> int | None:
        if any(d is None for d in self.shape):
            return None
        return math.prod(self.dims)

    @property
    def dims(self) -> tuple[int, ...]:
        """The shape as integers; only for a shape without unknown dimensions."""
        if any(d is None for d in self.shape):
            raise ValueError(f"Model tensor '{self.name}' has an unknown dimension in its shape {self.shape}.")
        return tuple(int(d) for d in self.shape if d is not None)

    def to_dict(self) -> dict:
        d: dict = {"name": self.name, "shape": list(self.shape), "dtype": self.dtype}
        if self.key is not None:
            d["key"] = self.key
        if self.class_axis != -1:
            d["class_axis"] = self.class_axis
        if self.ignore_index is not None:
            d["ignore_index"] = self.ignore_index
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "TensorSpec":
        ignore = d.get("ignore_index")
        ignore = None if ignore is None else int(ignore)
        return cls(d["name"], tuple(d["shape"]), d["dtype"], d.get("key"), int(d.get("class_axis", -1)), ignore)


def pack(values: list, specs: "Sequence[TensorSpec]", sequence=tuple):
    """Values in the model's structure: a dict by key for a model that takes (returns) a dict, the
    value alone for one tensor, else a ``sequence`` in the model's order."""
    if specs and all(s.key is not None for s in specs):
        return {s.key: v for s, v in zip(specs, values)}
    return values[0] if len(values) == 1 else sequence(values)


def unpack(value, specs: "Sequence[TensorSpec]") -> list:
    """The inverse of :func:`pack` for a model's predictions: one value per spec, in spec order."""
    if isinstance(value, dict):
        if all(s.key in value for s in specs):
            return [value[s.key] for s in specs]
        return list(value.values())
    if isinstance(value, (list, tuple)):
        return list(value)
    return [value]


def match_columns(cols, specs: "Sequence[TensorSpec]", param: str, what: str) -> list[str]:
    """The columns for the model's tensors, in the model's order.

    ``cols`` is a list (the model's order; when its names are exactly the model's input names or
    dict keys, in any order, they are matched by name) or a dict ``{tensor name or key: column}``.
    """
    names = [s.key if s.key is not None else s.name for s in specs]
    if isinstance(cols, dict):
        missing = [n for n in names if n not in cols]
        unknown = [k for k in cols if k not in names]
        if missing or unknown:
            raise ValueError(
                f"{param} maps the model's {what}s by name: expected the keys {names}. "
                f"Missing: {missing}; not {what}s of the model: {unknown}."
            )
        return [cols[n] for n in names]
    cols = list(cols)
    named = all(isinstance(c, str) for c in cols)
    if named and sorted(cols) == sorted(names) and len(set(names)) == len(names):
        return names  # the columns are named after the tensors: matched by name, whatever the order
    return cols


@dataclass(frozen=True)
class ColumnInfo:
    """How a DataFrame column is stored: kind 'scalar' | 'array' | 'vector', and its element type.

    ``stored`` is the column's name in the materialized Parquet files: a plain identifier
    (``c0``, ``c1``, ...), so that any legal Spark column name (``class``, ``od280/od315``,
    ``x.y``, ``_features``) works in every reader. Empty until :func:`with_stored_names`.
    """

    name: str
    kind: str
    element_type: str
    is_integer: bool
    stored: str = ""
    parts: tuple[str, ...] = ()  # scalar columns stacked (in this order) into one array; name: group_name(parts)

    def to_dict(self) -> dict:
        d = asdict(self)
        if not self.parts:
            del d["parts"]  # a plain column's dict has no "parts": its materialization key matches earlier writes
        return d


def group_name(parts: Sequence[str]) -> str:
    """How a group of stacked scalar columns is named in messages and statistics: ``[a, b, c]``."""
    return "[" + ", ".join(parts) + "]"


def column_label(c) -> str:
    """A feature_cols entry (a column, or a list of scalar columns to stack) as one name."""
    return c if isinstance(c, str) else group_name(c)


def stack_for_single_input(cols: list, specs: "Sequence[TensorSpec]") -> list:
    """Several plain columns for a model with one input: one group, stacked in the order given
    (13 numeric columns for a 13-wide input, without a VectorAssembler)."""
    if len(specs) == 1 and len(cols) > 1 and all(isinstance(c, str) for c in cols):
        return [list(cols)]
    return cols


def with_stored_names(*groups: Sequence[ColumnInfo | None]) -> list[list[ColumnInfo | None]]:
    """Gives every distinct column a stored name ``c<i>``, in order of first appearance.

    A column used twice (as a feature and as a label, say) gets one stored name.
    ``None`` entries (no sample weight) stay ``None``.
    """
    stored: dict[str, str] = {}
    out: list[list[ColumnInfo | None]] = []
    for group in groups:
        renamed: list[ColumnInfo | None] = []
        for info in group:
            if info is None:
                renamed.append(None)
                continue
            name = stored.setdefault(info.name, f"c{len(stored)}")
            renamed.append(replace(info, stored=name))
        out.append(renamed)
    return out


def check_string_input(col: str, element_type: str, spec: TensorSpec) -> None:
    """A string column feeds a model input of dtype ``string`` (StringLookup, TextVectorization,
    Hashing) and only such an input takes one; raises ValueError naming both otherwise."""
    if (element_type == "string") == (spec.dtype == "string"):
        return
    if element_type == "string":
        raise ValueError(
            f"Feature column '{col}' holds strings; model input '{spec.name}' takes {spec.dtype}. Give the model "
            f"a string input (keras.Input(shape=(1,), dtype='string')) followed by a preprocessing layer such as "
            "StringLookup, TextVectorization or Hashing, or index the column (StringIndexer)."
        )
    raise ValueError(
        f"Model input '{spec.name}' takes strings (dtype 'string'); feature column '{col}' holds {element_type} "
        "values. Feed it a string column."
    )


def check_feature_lengths(col: str, spec: TensorSpec, min_len: int | None, max_len: int | None, kind: str) -> None:
    """Raises ValueError when a feature column's rows do not fill the model input ``spec``. A binary
    column (``kind`` ``"binary"``) holds bytes that ``transformation_fn`` decodes on the ranks, where
    the decoded rows are checked."""
    if kind == "binary":
        return
    expected = spec.elements
    if kind == "scalar":
        if expected is not None and expected != 1:
            raise ValueError(
                f"Model input '{spec.name}' expects {expected} values per row (shape "
                f"{_shape(spec.shape)}); column '{col}' is a scalar column with 1 value per row. "
                "Use an array or Vector column, or assemble columns with VectorAssembler."
            )
        return
    if min_len != max_len:
        raise ValueError(
            f"Column '{col}' has ragged arrays: rows have between {min_len} and {max_len} values. "
            f"Model input '{spec.name}' expects {expected if expected is not None else 'a fixed number of'} "
            "values in every row."
        )
    if expected is not None and min_len != expected:
        raise ValueError(
            f"Model input '{spec.name}' expects {expected} values per row (shape {_shape(spec.shape)}); "
            f"column '{col}' has rows of length {min_len}."
        )


def class_index_shape(spec: TensorSpec) -> tuple[int, ...] | None:
    """The per-row shape of the class indices a sparse cross-entropy takes for output ``spec``: the output's
    shape without its class axis, Keras' last (``()`` for ``(C,)``, ``(12,)`` for a per-step ``(12, C)``,
    ``(H, W)`` for a per-pixel ``(H, W, C)``) or torch's first (``(12,)`` for ``(C, 12)``: ``CrossEntropyLoss``
    takes ``(N, C, d1, ...)``); None when a dimension is unknown."""
    if spec.elements is None or not spec.shape:
        return None
    dims = list(spec.dims)
    del dims[spec.class_axis]
    return tuple(dims)


def label_values(spec: TensorSpec, class_indices: bool = False) -> tuple[int, ...]:
    """The numbers of values per row a label of output ``spec`` may hold: class indices (a sparse
    cross-entropy) one per step or pixel of the output (:func:`class_index_shape`), other labels one
    (a class index or a scalar) or one per value of the output. Empty when the output's size is unknown."""
    if spec.elements is None:
        return ()
    if class_indices:
        return (math.prod(class_index_shape(spec) or ()),)
    return tuple(dict.fromkeys((1, spec.elements)))


def label_shapes(given, outputs: "Sequence[TensorSpec]", class_indices: "Sequence[bool | None]"):
    """The per-row shape each label is reshaped to on the ranks, one per output: ``given`` (horovod.spark's
    ``label_shapes``) when set; the class-index shape of an output of several axes trained with a sparse
    cross-entropy (per-step, per-pixel); None for the others (the reader's: the output's shape, ``()`` for
    one value per row). None when no label needs a shape of its own."""
    if given:
        return tuple(tuple(s) for s in given)
    shapes = tuple(
        class_index_shape(s) if sparse and len(s.shape) > 1 else None for s, sparse in zip(outputs, class_indices)
    )
    return shapes if any(s is not None for s in shapes) else None


def check_label_lengths(
    col: str, spec: TensorSpec, min_len: int | None, max_len: int | None, kind: str, class_indices: bool = False
) -> None:
    """Labels must hold what :func:`label_values` allows: one value per row (a class index or a scalar)
    or as many as the output; class indices of a sparse cross-entropy one per step (pixel) of the output."""
    n = 1 if kind == "scalar" else min_len
    if kind != "scalar" and min_len != max_len:
        raise ValueError(f"Label column '{col}' has ragged arrays: rows have between {min_len} and {max_len} values.")
    allowed = label_values(spec, class_indices)
    if not allowed or n in allowed:
        return
    if class_indices and len(spec.shape) > 1:
        steps = class_index_shape(spec)
        what = f"{allowed[0]} (one class index per step of the output: a label of shape {steps})"
    elif class_indices:
        what = "1 (a class index: the loss is a sparse cross-entropy)"
    else:
        what = f"1 (a class index or a scalar) or {spec.elements}"
    raise ValueError(
        f"Model output '{spec.name}' has shape {_shape(spec.shape)} ({spec.elements} values per row); "
        f"label column '{col}' has {n} values per row. Expected {what}."
    )


INT_RANGES = {
    "int8": (-(1 << 7), (1 << 7) - 1),
    "int16": (-(1 << 15), (1 << 15) - 1),
    "int32": (-(1 << 31), (1 << 31) - 1),
    "int64": (-(1 << 63), (1 << 63) - 1),
    "uint8": (0, (1 << 8) - 1),
    "uint16": (0, (1 << 16) - 1),
    "uint32": (0, (1 << 32) - 1),
    "uint64": (0, (1 << 64) - 1),
}
FLOAT_MAX = {"float16": 65504.0, "bfloat16": 3.3895313892515355e38, "float32": 3.4028234663852886e38}


def beyond_range(low, high, dtype: str):
    """A value of ``[low, high]`` that ``dtype`` cannot hold (an integer type: outside its range, a cast
    would wrap it; a narrow float: beyond its largest finite value, a cast would make it infinite), or
    None when all fit, or nothing is known (``low`` / ``high`` None, another type)."""
    if low is None or high is None:
        return None
    if dtype in INT_RANGES:
        lo, hi = INT_RANGES[dtype]
        return low if low < lo else high if high > hi else None
    if dtype in FLOAT_MAX:
        top = FLOAT_MAX[dtype]
        return low if low < -top else high if high > top else None
    return None


def check_value_range(role: str, col: str, low, high, dtype: str, spec: TensorSpec | None = None) -> None:
    """Raises ValueError naming the column and a value when its values (``low`` to ``high``) do not fit
    ``dtype``, the type the model gets them in: ``spec``'s for a feature (its model input), int32 for
    integer labels, float32 for the others (the reader's casts). Checked before any rank starts, so no
    cast wraps an id or turns a large number into an infinity."""
    bad = beyond_range(low, high, dtype)
    if bad is None:
        return
    if dtype in INT_RANGES:
        lo, hi = INT_RANGES[dtype]
        limit = f"{dtype}'s range [{lo}, {hi}]"
        if spec is not None:
            fix = (
                f"Give model input '{spec.name}' a wider integer type (keras.Input(..., dtype='int64')), or map the "
                f"values into {dtype}'s range."
            )
        else:
            fix = f"Map the labels into {dtype}'s range, or cast the column to double."
    else:
        limit = f"the largest {dtype} ({FLOAT_MAX[dtype]:.7g}): they would become infinite"
        fix = "Scale the column down" + (f", or give model input '{spec.name}' dtype='float64'." if spec else ".")
    into = f"model input '{spec.name}' takes {dtype}" if spec is not None else f"the model gets its values as {dtype}"
    raise ValueError(
        f"{role.capitalize()} column '{col}' holds values from {_num(low)} to {_num(high)}; {into}, and "
        f"{_num(bad)} is beyond {limit}. {fix}"
    )


def _num(x) -> str:
    return str(int(x)) if float(x).is_integer() and abs(x) < 2**63 else repr(x)


def _shape(shape) -> str:
    return "(None, " + ", ".join("None" if d is None else str(d) for d in shape) + ")" if shape else "(None,)"


def assign_files(
    files: Sequence[tuple[str, int]], num_proc: int, *, share: bool = True
) -> tuple[list[list[str]], list[int]]:
    """Spreads Parquet files over ranks, balancing rows (largest file to the lightest rank).

    A rank left without a file (fewer non-empty files than ranks) reads the smallest file
    as well when ``share`` (training: every rank needs data; the caller warns about it), or
    gets none (validation: every row must count once).

    Returns:
        (files per rank, rows per rank).
    """
    nonempty = sorted([(rows, path) for path, rows in files if rows > 0], key=lambda t: (-t[0], t[1]))
    if not nonempty:
        raise ValueError("assign_files needs at least one non-empty file.")
    per_rank: list[list[str]] = [[] for _ in range(num_proc)]
    load = [0] * num_proc
    for rows, path in nonempty:
        r = min(range(num_proc), key=lambda i: (load[i], i))
        per_rank[r].append(path)
        load[r] += rows
    smallest_rows, smallest = nonempty[-1]
    for r in range(num_proc if share else 0):
        if not per_rank[r]:
            per_rank[r].append(smallest)
            load[r] += smallest_rows
    return per_rank, load


def steps_per_epoch(rows: int, batch_size: int, num_proc: int) -> int:
    """Steps every rank runs per epoch so that, together, the ranks see each row about once."""
    return max(1, math.ceil(rows / (batch_size * num_proc)))


def specs_to_dicts(specs: Sequence[TensorSpec]) -> list[dict]:
    return [s.to_dict() for s in specs]
