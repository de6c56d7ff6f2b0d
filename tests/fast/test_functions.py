"""The user's functions as they travel with a model (common/functions.py): names of their own, and the
driver's saved lambdas replaced by references to the shipped ones."""

import json

from hvd_spark._internal.common import functions


def _factory(alpha):
    def loss_fn(y, p):
        return alpha * (y - p)

    return loss_fn


def test_closures_of_one_factory_get_names_of_their_own():
    a, b, c = _factory(1.0), _factory(4.0), _factory(9.0)
    names = functions.unique_names([a, b, a, c], taken={})
    assert id(a) not in names  # the first keeps Keras' own name, "loss_fn"
    assert names[id(b)] != names[id(c)]
    assert all(n.startswith("hvd_spark_fn>loss_fn_") for n in names.values())


def test_a_name_is_the_same_function_in_every_fit():
    """Names hold a digest of the function: two fits' models load side by side in one process."""
    first = functions.unique_names([_factory(1.0), _factory(4.0)], taken={})
    again = functions.unique_names([_factory(1.0), _factory(4.0)], taken={})
    other = functions.unique_names([_factory(1.0), _factory(5.0)], taken={})
    assert sorted(first.values()) == sorted(again.values())
    assert set(other.values()).isdisjoint(first.values())


def test_every_lambda_is_named_apart():
    f, g = (lambda t: t), (lambda t: t * 2)  # noqa: E731
    names = functions.unique_names([f, g], taken={})
    assert len(set(names.values())) == 2 and all(n.startswith("hvd_spark_fn>lambda_") for n in names.values())


def test_named_function_once_keeps_its_name():
    assert functions.unique_names([_factory], taken={}) == {}


def test_saved_lambdas_are_replaced_by_references_to_the_shipped_ones():
    layer_form = ["Y29kZQ==", None, None]  # what Keras' func_dump gives: code, defaults, closure
    loss_form = ["b3RoZXI=", None, None]
    config = {
        "config": {
            "layers": [
                {
                    "class_name": "Lambda",
                    "config": {
                        "name": "lambda",
                        "function": {
                            "class_name": "__lambda__",
                            "config": dict(zip(("code", "defaults", "closure"), layer_form)),
                        },
                    },
                }
            ]
        },
        "compile_config": {"loss": {"class_name": "__lambda__", "config": {"value": loss_form}}},
        "unknown": {"class_name": "__lambda__", "config": {"value": ["bm90IHNoaXBwZWQ=", None, None]}},
    }
    codes = {"hvd_spark_fn>lambda_a": layer_form[0], "hvd_spark_fn>lambda_b": loss_form[0]}
    config = json.loads(json.dumps(config))
    assert functions.resolve_lambdas(config, {functions.LAMBDA_CODES: codes}) == 2
    function = config["config"]["layers"][0]["config"]["function"]
    assert function == {
        "module": "builtins",
        "class_name": "function",
        "config": "hvd_spark_fn>lambda_a",
        "registered_name": "hvd_spark_fn>lambda_a",
    }
    assert config["compile_config"]["loss"]["config"] == "hvd_spark_fn>lambda_b"
    assert config["unknown"]["class_name"] == "__lambda__"  # not shipped by the driver: left to Keras' safe mode
