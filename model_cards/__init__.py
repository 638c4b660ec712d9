"""The model-card templates (`<model_type>.md`) that `looped_training.publish` and the models' `push_to_hub` render;
installed as `looped_training.model_cards`."""
