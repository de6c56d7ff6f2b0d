"""A rank's resident memory while it reads Parquet (rank/rows.py's ParquetSet, common/sources.py's
``parquet_file``): bounded by what it holds at once (a few row groups), not by the size of the table
it has read. Files that were memory-mapped kept every page read in the rank's RSS while they stayed
open (up to 64 per rank): 690 MiB at 1M rows, 1.9 GiB at 20M rows, read in place.

Each measurement runs in a fresh interpreter (pyarrow and numpy only), so that nothing else the test
process holds moves its RSS."""

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

FILES = 16
GROUPS = 6  # row groups per file
GROUP_ROWS = 16_384
WIDTH = 32  # float32 values per row: 128 bytes, about 2 MiB per row group
MIB = 1 << 20

_READ = textwrap.dedent(
    """
    import json, sys
    from hvd_spark._internal.common import sources
    from hvd_spark._internal.common.dataplan import Unit
    from hvd_spark._internal.rank.rows import ParquetSet

    def status():
        out = {}
        with open("/proc/self/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("VmRSS", "VmHWM", "RssFile", "RssAnon"):
                    out[key] = int(value.split()[0]) * 1024
        return out

    files, in_place, passes = json.loads(sys.argv[1]), sys.argv[2] == "1", int(sys.argv[3])
    source = None
    if in_place:
        source = sources.TableSource(
            (sources.SourceColumn("c0", "array", ("x",), "float32", "x"),
             sources.SourceColumn("c1", "scalar", ("y",), "float64", "y")),
            (),
        )
        names = ["c0", "c1"]
    else:
        names = ["x", "y"]
    import pyarrow.parquet as pq
    units = []
    for i, f in enumerate(files):
        meta = pq.ParquetFile(f).metadata
        units += [Unit(i, g, meta.row_group(g).num_rows) for g in range(meta.num_row_groups)]
    data = ParquetSet(files, source=source, workers=2)
    first = data.read(units[0], names)  # libraries loaded, one row group held: the baseline
    del first
    base = status()
    rows = 0
    for _ in range(passes):
        for k, unit in enumerate(units):
            data.prefetch(units[k + 1 : k + 2], names)  # as a rank reads: the next row group ahead
            block = data.read(unit, names)
            rows += len(block[names[0]])
            del block
    end = status()
    import gc
    import pyarrow as pa
    gc.collect()
    held = pa.total_allocated_bytes()  # Arrow's buffers still alive, every file still open
    data.close()
    print(json.dumps({"base": base, "end": end, "rows": rows, "arrow_held": held}))
    """
)


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    """FILES files of GROUPS row groups each: 16 x 6 x 2.8 MiB = 270 MiB, uncompressed (random floats)."""
    folder = tmp_path_factory.mktemp("table")
    rng = np.random.default_rng(0)
    files = []
    for i in range(FILES):
        path = str(folder / f"part-{i:03d}.parquet")
        x = rng.standard_normal((GROUPS * GROUP_ROWS, WIDTH), dtype=np.float32)
        offsets = pa.array(np.arange(0, x.size + 1, WIDTH, dtype=np.int32))
        t = pa.table({"x": pa.ListArray.from_arrays(offsets, pa.array(x.reshape(-1))), "y": x[:, 0].astype(np.float64)})
        pq.write_table(t, path, row_group_size=GROUP_ROWS, compression="none")
        files.append(path)
    group_bytes = pq.ParquetFile(files[0]).metadata.row_group(0).total_byte_size
    return files, group_bytes


def _read(files, in_place: bool, passes: int) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")])))
    out = subprocess.run(
        [sys.executable, "-c", _READ, json.dumps(files), "1" if in_place else "0", str(passes)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("in_place", [False, True], ids=["copy", "in_place"])
def test_rss_stays_bounded_by_row_groups_not_by_the_table(table, in_place):
    files, group_bytes = table
    table_bytes = sum(os.path.getsize(f) for f in files)
    assert table_bytes > 40 * group_bytes  # a table many row groups large
    got = _read(files, in_place, passes=2)
    assert got["rows"] == 2 * FILES * GROUPS * GROUP_ROWS
    base, end = got["base"], got["end"]
    # Mapped files add every page read to the process's file-backed RSS: the whole table (270 MiB).
    assert end["RssFile"] - base["RssFile"] < 4 * group_bytes, (got, group_bytes)
    # Nothing read stays held by an open file (pyarrow's pre_buffer cache keeps each file's last row
    # group read: 16 files, 16 row groups).
    assert got["arrow_held"] < 2 * group_bytes, (got, group_bytes)
    # Everything resident at its peak, above the baseline: the row groups held at once (the one
    # converted, the one read ahead, their numpy copies) and the allocator's arenas of the reading
    # threads, 20-50 MiB here whether the table is read once or 4 times; not the table.
    assert end["VmHWM"] - base["VmRSS"] < table_bytes / 4, (got, table_bytes)
