"""Binary feature columns without Spark: a transformation_fn's decoded bytes stacked into the model
input's shape (ranks and transform), its mistakes named, and a table's binary column read in place
(values, schema check, statistics from the values and from the footer)."""

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hvd_spark._internal.common import sources
from hvd_spark._internal.common.specs import ColumnInfo, TensorSpec, check_feature_lengths
from hvd_spark._internal.data import footers
from hvd_spark._internal.infer.batching import column_transformation
from hvd_spark._internal.rank.rows import transformation

IMAGE = ColumnInfo("content", "binary", "binary", False, stored="c0")
LABEL = ColumnInfo("label", "scalar", "int", True, stored="c1")
PIXELS = TensorSpec("pixels", (2, 2, 1), "float32")


def _pngs(n: int) -> np.ndarray:
    """n rows of 4 bytes each (a stand-in for encoded images), as the reader gives them: objects."""
    return np.array([bytes([i, i + 1, i + 2, i + 3]) for i in range(n)], dtype=object)


def _decode(frame: pd.DataFrame) -> pd.DataFrame:
    frame["content"] = [np.frombuffer(b, dtype=np.uint8).reshape(2, 2) / 255.0 for b in frame["content"]]
    return frame


def test_decoded_bytes_take_the_input_shape_and_the_rest_stays():
    apply = transformation(_decode, [IMAGE], [LABEL], None, [PIXELS])
    out = apply({"c0": _pngs(3), "c1": np.array([7, 8, 9], dtype=np.int32)})
    assert out["c0"].shape == (3, 2, 2, 1) and out["c0"].dtype.kind == "f"
    np.testing.assert_allclose(out["c0"][1].reshape(-1), np.array([1, 2, 3, 4]) / 255.0)
    assert out["c1"].tolist() == [7, 8, 9] and out["c1"].dtype == np.int32


@pytest.mark.parametrize(
    "fn,match",
    [
        (lambda f: f, "must turn binary column 'content' into numbers .* Received: bytes values"),
        (
            lambda f: f.assign(content=[np.zeros(3)] * len(f)),
            r"decodes to 3 values per row \(shape \(3,\)\); model input 'pixels' takes 4",
        ),
        (lambda f: f.assign(content=[np.zeros(4), np.zeros(5), np.zeros(4)]), "decodes to arrays of 4 to 5 values"),
        (lambda f: f.drop(columns=["content"]), "no usable column 'content'"),
    ],
)
def test_a_transformation_that_does_not_decode_is_named(fn, match):
    apply = transformation(fn, [IMAGE], [LABEL], None, [PIXELS])
    with pytest.raises(ValueError, match=match):
        apply({"c0": _pngs(3), "c1": np.array([7, 8, 9], dtype=np.int32)})


def test_transform_decodes_the_feature_columns_only():
    seen = []

    def fn(frame):
        seen.append(list(frame.columns))
        return _decode(frame)

    group = ColumnInfo("[a, b]", "array", "float", False, parts=("a", "b"))
    transform = column_transformation(fn, [IMAGE, group], [PIXELS, TensorSpec("ab", (2,), "float32")])
    pandas_group = np.empty(3, dtype=object)  # what the pandas UDF gives for an array column
    for i in range(3):
        pandas_group[i] = np.array([i, -i], dtype=np.float32)
    image, ab = transform([_pngs(3), pandas_group])
    assert seen == [["content", "a", "b"]]
    assert image.shape == (3, 2, 2, 1) and ab.shape == (3, 2) and ab[2].tolist() == [2.0, -2.0]


def test_a_binary_column_has_no_length_to_check():
    check_feature_lengths("content", PIXELS, None, None, "binary")  # its decoded rows are checked on the ranks


def test_a_tables_binary_column_read_in_place(tmp_path):
    col = sources.SourceColumn("c0", "scalar", ("content",), sources.stored_dtype("binary", "binary", False), "content")
    source = sources.TableSource((col,))
    table = pa.table({"content": pa.array([b"\x89PNG1", None, b"\x89PNG3"], type=pa.binary())})
    assert sources.values_of(col, table).tolist() == [b"\x89PNG1", None, b"\x89PNG3"]
    sources.check_file_schema(source, "t.parquet", table.schema)
    with pytest.raises(ValueError, match="not the scalar expected"):
        sources.check_file_schema(source, "t.parquet", pa.schema([("content", pa.string())]))
    stats = sources.row_group_stats(source, "t.parquet", table, 0)["columns"]["content"]
    assert stats["bad"] == 1 and stats["min"] is None  # a null is refused; bytes have no range
    path = tmp_path / "t.parquet"
    pq.write_table(table, path)
    meta = pq.ParquetFile(path).metadata
    footer = footers.file_stats(source, str(path), meta, pq.ParquetFile(path).schema_arrow)
    assert footer[0][2]["missing"] == [] and footer[0][2]["columns"]["content"]["bad"] == 1
