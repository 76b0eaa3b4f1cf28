"""The suite's warning filters (pyproject.toml): isojax's own deprecated calls fail the tests."""

import warnings

import pytest

from isojax.core import stats


@pytest.mark.parametrize("category", [DeprecationWarning, PendingDeprecationWarning])
def test_isojax_deprecation_warnings_are_errors(category):
    with pytest.raises(category, match="old call"):
        warnings.warn_explicit(
            "old call", category, filename=stats.__file__, lineno=1, module="isojax.core.stats"
        )
