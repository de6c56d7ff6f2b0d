"""Resume after an interruption: a training run is cut off, and a second fit continues it.

    .venv/bin/python examples/resume_after_interruption.py [--store ./hvd_spark_store]

The first fit asks for 6 epochs, but one rank's process is killed (SIGKILL) at the end of
epoch 3, as a lost executor would be. The fit fails and names the rank. A second fit with the
same run_id continues from the latest complete checkpoint, at the next epoch, and stops at
epoch 6: the history covers every epoch once and the optimizer's step counter continues.
(With max_restarts=1 the first fit would have recovered by itself.)
"""

import argparse
import logging
import os
import signal
import uuid


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--store", default=os.path.join(os.getcwd(), "hvd_spark_store"))
    a = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("py4j").setLevel(logging.WARNING)
    logging.getLogger("hvd_spark.rank").setLevel(logging.WARNING)

    import keras

    import hvd_spark
    from hvd_spark import HorovodEstimator, RankFailedError

    sys_path = os.path.dirname(os.path.abspath(__file__))
    import sys

    sys.path.insert(0, sys_path)
    from digits import digits_frames, digits_model

    class Interrupt(keras.callbacks.Callback):
        """Kills rank 1's process at the end of epoch 3 (once)."""

        def on_epoch_end(self, epoch, logs=None):
            if epoch == 2 and os.environ.get("HVD_SPARK_RANK") == "1":
                os.kill(os.getpid(), signal.SIGKILL)

    spark = hvd_spark.local_session("local[2]", app_name="hvd_spark-resume")
    spark.sparkContext.setLogLevel("ERROR")
    run_id = f"resume-demo-{uuid.uuid4().hex[:6]}"
    common = dict(
        num_proc=2,
        store=a.store,
        model=digits_model(),
        optimizer=keras.optimizers.Adam(0.002),
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
        feature_cols=["features"],
        label_cols=["label"],
        validation=0.1,
        epochs=6,
        run_id=run_id,
    )
    try:
        train_df, _ = digits_frames(spark)
        try:
            HorovodEstimator(callbacks=[Interrupt()], **common).fit(train_df)
        except RankFailedError as e:
            print(f"first fit interrupted as planned: {str(e).splitlines()[0]}")
        store = hvd_spark.Store(a.store)
        print(f"complete checkpoints after the interruption: {[c.epoch for c in store.checkpoints(run_id)]}")
        est = HorovodEstimator(**common)
        fitted = est.fit(train_df)
        history = fitted.getHistory()
        print(
            f"second fit resumed; history now covers {len(history['loss'])} epochs: "
            f"val_accuracy {[round(v, 3) for v in history['val_accuracy']]}"
        )
        summary = fitted.getFitSummary()
        print(f"optimizer steps: {summary.ranks[0].iterations} (= 6 epochs x {summary.steps_per_epoch} steps)")
    finally:
        spark.stop()


if __name__ == "__main__":
    main()
