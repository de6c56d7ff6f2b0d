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


def test_a_name_already_taken_by_another_object_is_not_reused():
    a = _factory(1.0)
    names = functions.unique_names([a], taken={"loss_fn": _factory(2.0), "hvd_spark_fn>loss_fn_0": object()})
    assert names[id(a)] == "hvd_spark_fn>loss_fn_1"


def test_every_lambda_is_named_apart():
    f, g = (lambda t: t), (lambda t: t * 2)  # noqa: E731
    names = functions.unique_names([f, g], taken={})
    assert sorted(names.values()) == ["hvd_spark_fn>lambda_0", "hvd_spark_fn>lambda_1"]


def test_named_function_once_keeps_its_name():
    assert functions.unique_names([_factory], taken={}) == {}


def test_saved_lambdas_are_replaced_by_references_to_the_shipped_ones():
    layer_form = ["Y29kZQ==", None, [1.5]]  # what Keras' func_dump gives: code, defaults, closure
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
    codes = {"hvd_spark_fn>lambda_0": layer_form, "hvd_spark_fn>lambda_1": loss_form}
    config = json.loads(json.dumps(config))
    assert functions.resolve_lambdas(config, {functions.LAMBDA_CODES: codes}) == 2
    function = config["config"]["layers"][0]["config"]["function"]
    assert function == {
        "module": "builtins",
        "class_name": "function",
        "config": "hvd_spark_fn>lambda_0",
        "registered_name": "hvd_spark_fn>lambda_0",
    }
    assert config["compile_config"]["loss"]["config"] == "hvd_spark_fn>lambda_1"
    assert config["unknown"]["class_name"] == "__lambda__"  # not shipped by the driver: left to Keras' safe mode


def test_adopt_renames_shipped_lambda_copies_only():
    f = lambda t: t  # noqa: E731
    g = _factory(1.0)
    functions.adopt({"hvd_spark_fn>lambda_3": f, "hvd_spark_fn>loss_fn_1": g, "other": lambda t: t})
    assert f.__name__ == "lambda_3" and g.__name__ == "loss_fn"
