"""``hvd_spark.local_session``'s ``prewarm``: True, False, or the num_proc of the fits to come; anything
else is refused before a session starts."""

import pytest

import hvd_spark


@pytest.mark.parametrize("bad", [0, -2, "2", 1.5, None])
def test_a_bad_prewarm_is_refused_naming_it(bad):
    with pytest.raises(ValueError, match=r"prewarm must be True, False or the num_proc .* Received: prewarm="):
        hvd_spark.local_session("local[1]", prewarm=bad)
