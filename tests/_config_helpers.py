"""One check shared by both models' config tests: a bad value is refused however it arrives."""

import json

import pytest


def assert_refused_however_it_arrives(make_config, model_class, auto_class, checkpoint, tmp_path, field, value,
                                      message):
    """Constructor, attribute set (the old value kept), `from_pretrained` kwargs (set by transformers after
    `__init__`) on the model class and its Auto class, and config.json: each raises ValueError matching `message`."""
    with pytest.raises(ValueError, match=message):
        make_config(**{field: value})
    config = make_config()
    before = getattr(config, field)
    with pytest.raises(ValueError, match=message):
        setattr(config, field, value)
    assert getattr(config, field) == before
    for cls in (model_class, auto_class):
        with pytest.raises(ValueError, match=message):
            cls.from_pretrained(checkpoint, **{field: value})
    data = json.loads((checkpoint / "config.json").read_text())
    data[field] = value
    (tmp_path / "config.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match=message):
        type(config).from_pretrained(tmp_path)
