"""One check shared by both models' config tests: a bad value is refused however it arrives."""

import json
import re

import pytest
from huggingface_hub.errors import StrictDataclassClassValidationError, StrictDataclassError


def assert_refused_however_it_arrives(
    make_config, model_class, auto_class, checkpoint, tmp_path, field, value, message
):
    """Constructor, attribute set, `from_pretrained` kwargs (set by transformers after `__init__`) on the model class
    and its Auto class, and config.json: each raises huggingface_hub's strict-dataclass error matching `message`. An
    attribute set breaking a field's own rule is refused at once (the old value kept); one breaking a rule between
    fields is refused by `config.validate()` (which `save_pretrained` runs), as transformers' configs do."""
    with pytest.raises(StrictDataclassError, match=message):
        make_config(**{field: value})
    config = make_config()
    before = getattr(config, field)
    try:
        setattr(config, field, value)
    except StrictDataclassError as error:
        assert re.search(message, str(error)), str(error)
        assert getattr(config, field) == before
    else:
        with pytest.raises(StrictDataclassClassValidationError, match=message):
            config.validate()
    for cls in (model_class, auto_class):
        with pytest.raises(StrictDataclassError, match=message):
            cls.from_pretrained(checkpoint, **{field: value})
    data = json.loads((checkpoint / "config.json").read_text())
    data[field] = value
    (tmp_path / "config.json").write_text(json.dumps(data))
    with pytest.raises(StrictDataclassError, match=message):
        type(config).from_pretrained(tmp_path)
