"""A run goes on only with its own data, split the same way (``plan.check_data``): the data records the
estimator builds (a table read in place by its files, a copy by its query and input files, the split's
params), compared without Spark. The fits themselves are in tests/test_inplace.py and
tests/test_estimator.py."""

import logging

import pytest

from hvd_spark._internal.data.store import Checkpoint, Store
from hvd_spark._internal.ml import plan

ROOT = "file:/data/t/"
IN_PLACE = {
    "read": "in place",
    "table": "t",
    "root": ROOT,
    "files": [[ROOT + "part-0.parquet", 100, 1], [ROOT + "part-1.parquet", 120, 1]],
    "validation": 0.25,
    "random_seed": 0,
    "validation_files": None,
    "sample_weight_col": None,
}
COPIED = {
    "read": "copied",
    "why_copied": "its query has a Filter",
    "identified": True,
    "query": "q1",
    "rows_in_plan": None,
    "files": [[ROOT + "part-0.parquet", 100, 1]],
    "validation": 0.25,
    "random_seed": 0,
    "sample_weight_col": None,
}


@pytest.fixture
def store(tmp_path):
    return Store(str(tmp_path / "store"))


def _resumed(store, run_data, run_id="r1"):
    """The plan of a fit of a run that has one epoch and ``run_data`` in its run.json."""
    folder = store.checkpoints_path(run_id)
    ckpt = Checkpoint(1, f"{folder}/epoch-0001.keras", f"{folder}/epoch-0001.json")
    run_json = f"{store.run_path(run_id)}/run.json"
    return plan.ResumePlan(run_id, "fp", run_json, ckpt, [{"loss": 1.0}], None, "fit-1", run_data=run_data)


@pytest.mark.parametrize("record", [IN_PLACE, COPIED])
def test_the_same_data_goes_on(store, record, caplog):
    with caplog.at_level(logging.WARNING):
        plan.check_data(store, _resumed(store, dict(record, rows={"train": 6, "val": 2})), dict(record))
    assert caplog.text == ""
    assert plan.data_differences(record, dict(record, validation_files=[], sample_weight_col="")) == []  # unset


def test_a_new_run_compares_nothing(store):
    fresh = plan.ResumePlan("r1", "fp", "run.json", None, [], run_data=None)
    plan.check_data(store, fresh, COPIED)  # nothing trained yet: any data starts the run


@pytest.mark.parametrize(
    "run, fit, says",
    [
        (IN_PLACE, dict(IN_PLACE, files=IN_PLACE["files"] + [[ROOT + "part-2.parquet", 9, 2]]), "added: part-2"),
        (IN_PLACE, dict(IN_PLACE, files=IN_PLACE["files"][:1]), "files of the table removed: part-1.parquet"),
        (
            IN_PLACE,
            dict(IN_PLACE, files=[IN_PLACE["files"][0], [ROOT + "part-1.parquet", 120, 7]]),
            "files of the table changed in size or modification time: part-1.parquet",
        ),
        (IN_PLACE, dict(IN_PLACE, root="file:/data/"), "the table's folder"),
        (IN_PLACE, dict(IN_PLACE, validation=0.3), "validation: 0.25 -> 0.3"),
        (IN_PLACE, dict(IN_PLACE, random_seed=1), "random_seed (the validation split's seed): 0 -> 1"),
        (IN_PLACE, dict(IN_PLACE, validation="is_val", random_seed=None), "validation: 0.25 -> 'is_val'"),
        (IN_PLACE, dict(IN_PLACE, sample_weight_col="w"), "sample_weight_col: None -> 'w'"),
        (
            IN_PLACE,
            COPIED,
            "read: the table at file:/data/t/ read in place (2 files; validation rows drawn by file and row number) "
            "-> a copy in the store (validation rows drawn by the rows' values, because its query has a Filter)",
        ),
        (COPIED, IN_PLACE, "read: a copy in the store"),
        (COPIED, dict(COPIED, query="q2"), "the DataFrame's query"),
        (COPIED, dict(COPIED, rows_in_plan="7"), "the DataFrame's query or the rows held in it"),
        (COPIED, dict(COPIED, files=[[ROOT + "part-0.parquet", 101, 1]]), "input files changed in size"),
    ],
)
def test_other_data_is_refused_naming_what_differs_and_how_to_go_on(store, run, fit, says):
    p = _resumed(store, dict(run, rows={"train": 6, "val": 2}))
    with pytest.raises(ValueError, match="run_id 'r1' in .* was trained on other data") as info:
        plan.check_data(store, p, fit)
    message = str(info.value)
    assert says in message, message
    assert "The run trained on 6 training and 2 validation rows of " in message
    assert "epoch-0001.keras" in message and "set_weights" in message and "new run_id" in message
    assert not store.files.exists(store.run_path("r1"))  # nothing read or written


def test_many_changed_files_are_counted_not_listed():
    many = dict(IN_PLACE, files=IN_PLACE["files"] + [[f"{ROOT}new-{i}.parquet", 1, 1] for i in range(5)])
    (diff,) = plan.data_differences(IN_PLACE, many)
    assert diff == "files of the table added: new-0.parquet, new-1.parquet, new-2.parquet and 2 more"


def test_data_without_identity_compares_the_split_only_and_says_so(store, caplog):
    rdd = dict(COPIED, identified=False, why="an RDD or a cache of the Spark application that fitted it")
    for query in ("q1", "other"):  # the rows cannot be compared: either way the fit goes on, with a warning
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            plan.check_data(store, _resumed(store, COPIED), dict(rdd, query=query))
        assert "the rows of this fit's data cannot be compared (an RDD or a cache" in caplog.text
    with caplog.at_level(logging.WARNING):
        plan.check_data(store, _resumed(store, rdd), COPIED)
    assert "the rows of the run's data cannot be compared" in caplog.text
    with pytest.raises(ValueError, match="validation: 0.25 -> 0.5"):  # the split still counts
        plan.check_data(store, _resumed(store, rdd), dict(rdd, validation=0.5))
    with pytest.raises(ValueError, match="read: a copy in the store"):  # and how the data is read
        plan.check_data(store, _resumed(store, rdd), IN_PLACE)


def test_a_run_recorded_before_data_records_warns_and_records_this_fits(store, caplog):
    p = _resumed(store, None)
    store.files.write_json(p.run_json, {"run_id": "r1", "feature_cols": ["x"]})
    with caplog.at_level(logging.WARNING):
        plan.check_data(store, p, IN_PLACE)
    assert "recorded before runs recorded their data" in caplog.text
    plan.record_run(store, p, feature_cols=["x"], label_cols=["y"], data_key="k", data=IN_PLACE)
    assert store.files.read_json(p.run_json) == {"run_id": "r1", "feature_cols": ["x"], "data": IN_PLACE}
    recorded = _resumed(store, IN_PLACE)
    plan.record_run(store, recorded, feature_cols=["x"], label_cols=["y"], data_key="k", data=COPIED)
    assert store.files.read_json(p.run_json)["data"] == IN_PLACE  # a run keeps its own record


def test_one_file_in_two_url_forms_is_one_file():
    """``inputFiles()`` says ``file:///x``, a plan's location ``file:/x``, fit_on_parquet a plain path."""
    other = dict(
        IN_PLACE, root="/data/t", files=[["file:///data/t/" + f[0][len(ROOT) :], *f[1:]] for f in IN_PLACE["files"]]
    )
    assert plan.data_differences(IN_PLACE, other) == []
    grown = dict(other, files=other["files"] + [["file:///data/t/sub/part-9.parquet", 1, 1]])
    assert plan.data_differences(IN_PLACE, grown) == ["files of the table added: sub/part-9.parquet"]


def test_a_run_whose_table_fell_back_to_a_copy_is_copied_again(store):
    """The scan found a file the ranks cannot read in place, so the run's data was copied: a resume copies
    it again (its split), instead of reading in place and being refused for reading another way."""
    fell_back = dict(COPIED, why_copied="column 'a' of the Parquet file f has type string", fell_back=True)
    assert plan.copy_again(_resumed(store, fell_back), "auto") == fell_back["why_copied"]
    for run_data, materialize in [(COPIED, "auto"), (fell_back, "never"), (None, "auto")]:
        assert plan.copy_again(_resumed(store, run_data), materialize) is None
    fresh = plan.ResumePlan("r1", "fp", "run.json", None, [], run_data=fell_back)
    assert plan.copy_again(fresh, "auto") is None  # a new run tries the table in place


def test_without_a_random_split_in_place_and_copied_are_the_same_data():
    """No validation fraction: the rows and the split do not depend on how the files are read, so only
    the files count; with a fraction, reading the other way draws another split and is refused."""
    no_split = dict(IN_PLACE, validation=None, random_seed=None)
    copied = dict(
        COPIED, validation=None, random_seed=None, identified=True, files=[list(f) for f in IN_PLACE["files"]]
    )
    assert plan.data_differences(no_split, copied) == []
    grown = dict(copied, files=copied["files"] + [[ROOT + "part-9.parquet", 1, 1]])
    assert plan.data_differences(no_split, grown) == ["input files added: /data/t/part-9.parquet"]
    with_split = dict(IN_PLACE, validation=0.2, random_seed=0)
    assert plan.data_differences(with_split, dict(copied, validation=0.2, random_seed=0))[0].startswith("read: ")
