"""hvd_spark.SparkBackend with horovod.spark's constructor: how its arguments map onto hvd_spark's
launcher (no Spark: the fit's side is ml/backend.py's fit_launch_args and fit_backend)."""

import dataclasses
import io
import logging
import re
import sys

import pytest

import hvd_spark
from hvd_spark._internal.common import channel
from hvd_spark._internal.ml import backend as backend_mod
from hvd_spark._internal.ml.backend import (
    LAUNCH_ARGS,
    InProcessBackend,
    RankOutput,
    SparkBackend,
    fit_backend,
    fit_launch_args,
    launches_with_spark,
)


@dataclasses.dataclass(frozen=True)
class _Options:  # the two fields of driver/launcher.py's LaunchOptions that a resize changes
    num_proc: int
    slots: int


# What ml/checks.py's _launch_options hands resolve_launch_options for a fit with default params.
FIT_ARGS = dict(
    warm=None,
    num_proc=2,
    backend="gloo",
    start_timeout=None,
    stall_timeout=None,
    stall_default=300.0,
    use_gpu=None,
    env={"A": "fit"},
)


def test_the_horovod_names_are_public():
    assert hvd_spark.SparkBackend is SparkBackend
    for name in ("KerasEstimator", "KerasModel", "SparkBackend", "Store"):
        assert name in hvd_spark.__all__
    # horovod.spark.keras's names are the same classes, loaded lazily (they need pyspark.ml and Keras)
    assert hvd_spark._LAZY["KerasEstimator"] == "hvd_spark._internal.ml.estimator:HorovodEstimator"
    assert hvd_spark._LAZY["KerasModel"] == "hvd_spark._internal.ml.transformer:TFTransformer"


def test_horovods_example_arguments_are_taken():
    """The examples' call: SparkBackend(num_proc=..., stdout=sys.stdout, stderr=sys.stderr,
    prefix_output_with_timestamp=True)."""
    backend = SparkBackend(num_proc=2, stdout=sys.stdout, stderr=sys.stderr, prefix_output_with_timestamp=True)
    assert backend.num_processes() == 2
    assert launches_with_spark(backend) and launches_with_spark(None)
    assert not launches_with_spark(InProcessBackend(2))
    out = backend._output
    assert isinstance(out, RankOutput) and out.stream is sys.stdout and out.tag == "stdout" and out.timestamp


def test_output_lines_have_horovods_format():
    buf = io.StringIO()
    RankOutput(buf, "stdout", timestamp=False)(1, "Epoch 1/2")
    assert buf.getvalue() == "[1]<stdout>:Epoch 1/2\n"
    buf = io.StringIO()
    RankOutput(buf, "stderr", timestamp=True)(0, "x")
    # time.asctime(), as horovod's safe_shell_exec prefixes: "Mon Nov 23 10:00:00 2026[0]<stderr>:x"
    assert re.fullmatch(r"\w{3} \w{3} [ \d]\d \d\d:\d\d:\d\d \d{4}\[0\]<stderr>:x\n", buf.getvalue())


def test_stderr_alone_receives_the_lines_and_both_warn(caplog):
    buf = io.StringIO()
    assert SparkBackend(stderr=buf)._output.stream is buf
    assert SparkBackend(stderr=buf)._output.tag == "stderr"
    assert SparkBackend()._output is None  # the hvd_spark.rank logger
    with caplog.at_level(logging.WARNING, logger="hvd_spark"):
        SparkBackend(stdout=io.StringIO(), stderr=io.StringIO())
    assert "stderr lines go to stdout" in caplog.text and "merged" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="hvd_spark"):
        SparkBackend(stdout=buf, stderr=buf)  # one stream for both: nothing is lost, no warning
    assert caplog.text == ""


def test_a_broken_stream_falls_back_to_the_log(caplog):
    class Broken:
        def write(self, text):
            raise OSError("closed")

    with caplog.at_level(logging.INFO, logger="hvd_spark"):
        out = RankOutput(Broken(), "stdout", timestamp=False)
        out(0, "one")
        out(1, "two")
    assert caplog.text.count("failed") == 1 and "[rank 1] two" in caplog.text


def test_arguments_that_make_no_sense_here():
    with pytest.raises(ValueError, match="extra_mpi_args is not supported"):
        SparkBackend(extra_mpi_args="-x FOO")
    SparkBackend(extra_mpi_args="")  # empty: nothing to pass
    with pytest.raises(ValueError, match="executable is not supported.*PYSPARK_PYTHON"):
        SparkBackend(executable="/usr/bin/python2")
    SparkBackend(executable=sys.executable)  # horovod's default, spelled out
    with pytest.raises(TypeError, match="unexpected argument.*ssh_port"):
        SparkBackend(ssh_port=22)
    with pytest.raises(ValueError, match="num_proc must be a positive integer"):
        SparkBackend(num_proc=0)
    with pytest.raises(TypeError, match="stdout must be a file-like object"):
        SparkBackend(stdout="out.txt")
    with pytest.raises(TypeError, match="prefix_output_with_timestamp must be True or False"):
        SparkBackend(prefix_output_with_timestamp="yes")
    with pytest.raises(ValueError, match="verbose must be 0, 1 or 2"):
        SparkBackend(verbose=5)
    with pytest.raises(TypeError, match="env must map str to str"):
        SparkBackend(env={"N": 1})


def test_nics_are_accepted_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="hvd_spark"):
        SparkBackend(nics=["eth0"])
    assert "nics=['eth0'] is ignored" in caplog.text


def test_a_fit_takes_the_backends_launcher_arguments():
    backend = SparkBackend(num_proc=2, env={"A": "backend", "B": "b"}, start_timeout=30, use_mpi=True, timeout=600)
    args = fit_launch_args(backend, dict(FIT_ARGS))
    assert args["env"] == {"A": "backend", "B": "b"}  # over backend_env
    assert args["start_timeout"] == 30 and args["timeout"] == 600
    assert args["backend"] is None and args["use_mpi"] is True  # the controller is the backend's
    assert args["num_proc"] == 2 and args["stall_default"] == 300.0
    assert "spark" not in args
    assert fit_launch_args(None, dict(FIT_ARGS)) == FIT_ARGS
    assert fit_launch_args(InProcessBackend(2), dict(FIT_ARGS)) == FIT_ARGS
    assert fit_launch_args(SparkBackend(), dict(FIT_ARGS)) == FIT_ARGS  # nothing given: the fit's own


def test_an_argument_set_in_both_places_must_agree():
    backend = SparkBackend(start_timeout=30, warm=True)
    assert fit_launch_args(backend, dict(FIT_ARGS, start_timeout=30))["start_timeout"] == 30
    with pytest.raises(ValueError, match=r"start_timeout is set both on the estimator \(60\) and on its SparkBackend"):
        fit_launch_args(backend, dict(FIT_ARGS, start_timeout=60))
    with pytest.raises(ValueError, match="warm is set both"):  # mp_start_method="spawn" on the estimator
        fit_launch_args(backend, dict(FIT_ARGS, warm=False))


def test_the_fit_runs_hvd_spark_training_on_the_backends_ranks_with_its_output(monkeypatch):
    # rank_function's default is rank/train.py's train, which imports Keras: stood in for here
    monkeypatch.setattr(
        backend_mod, "rank_function", lambda b, default=None: "train" if b.rank_fn is None else b.rank_fn
    )
    buf = io.StringIO()
    backend = SparkBackend(num_proc=2, env={"A": "1"}, stdout=buf, start_timeout=30)
    launch_kwargs = dict(
        options=_Options(num_proc=2, slots=2), on_event=print, description="HorovodEstimator.fit", spark=None
    )
    fitted, rank_fn = fit_backend(backend, **launch_kwargs)
    assert isinstance(fitted, SparkBackend) and fitted is not backend and rank_fn == "train"
    assert fitted._kwargs == launch_kwargs  # the fit's resolved options, progress, session
    assert fitted._num_proc == 2 and fitted._env == {"A": "1"} and fitted._output is backend._output
    assert backend._kwargs == {"start_timeout": 30}  # the user's object is left as it was
    resized = fitted.with_num_proc(1)
    assert resized._num_proc == 1 and resized._output is backend._output and resized.num_processes() == 1
    assert set(LAUNCH_ARGS) >= {"start_timeout", "use_gloo", "use_mpi"}  # horovod.spark.run's that apply


def test_spark_connect_output_goes_where_the_backend_says():
    lines = []
    channel.show([{"k": "log", "rank": 1, "line": "hello"}], None, lambda rank, line: lines.append((rank, line)))
    assert lines == [(1, "hello")]
