"""The public names of `hf_cfp` and `hf_cfp.anchor`, imported on first use (PEP 562), are the objects their
defining modules hold, reachable by attribute, `from ... import` and `import *`; an unknown name still fails."""

import importlib

import pytest

import hf_cfp
import hf_cfp.anchor
from hf_cfp.anchor.fingerprint import check_fingerprint, model_fingerprint

DEFINED_IN = {
    "FisherAnchor": "hf_cfp.anchor.artifact",
    "kl_to_base": "hf_cfp.evaluation.kl",
    "estimate_fisher": "hf_cfp.fisher.estimate",
    "CFP": "hf_cfp.integrations.loop",
    "CFPCallback": "hf_cfp.integrations.callback",
    "KLToBaseCallback": "hf_cfp.integrations.kl_callback",
    "CFPError": "hf_cfp.errors",
    "__version__": "hf_cfp.version",
}
# moved to their subpackages: not at the top level any more
SUBPACKAGE_ONLY = {
    "CFPState": "hf_cfp.protection",
    "CFPConfig": "hf_cfp.launch",
    "load_embedded_model": "hf_cfp.loading",
    "kl_to_base_with_stderr": "hf_cfp.evaluation",
    "KLEstimate": "hf_cfp.evaluation",
    "CFPArgumentError": "hf_cfp.errors",
    "AnchorNotFoundError": "hf_cfp.errors",
    "AnchorMismatchError": "hf_cfp.errors",
}


@pytest.mark.parametrize("name", sorted(DEFINED_IN))
def test_a_public_name_is_the_defining_module_s_object(name):
    expected = getattr(importlib.import_module(DEFINED_IN[name]), name)
    assert getattr(hf_cfp, name) is expected
    namespace: dict = {}
    exec(f"from hf_cfp import {name}", namespace)
    assert namespace[name] is expected


def test_star_import_and_dir_give_every_public_name():
    namespace: dict = {}
    exec("from hf_cfp import *", namespace)
    assert set(hf_cfp.__all__) <= set(namespace) and set(hf_cfp.__all__) <= set(dir(hf_cfp))
    assert set(DEFINED_IN) == set(hf_cfp.__all__)  # what a user needs, nothing more
    assert hf_cfp.anchor.check_fingerprint is check_fingerprint
    assert hf_cfp.anchor.model_fingerprint is model_fingerprint


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="has no attribute 'FisherAnchors'"):
        _ = hf_cfp.FisherAnchors
    with pytest.raises(ImportError):
        exec("from hf_cfp.anchor import nothing_here", {})


@pytest.mark.parametrize("name", sorted(SUBPACKAGE_ONLY))
def test_the_other_names_live_in_their_subpackages_only(name):
    assert hasattr(importlib.import_module(SUBPACKAGE_ONLY[name]), name)
    with pytest.raises(AttributeError):
        getattr(hf_cfp, name)
