"""`push_to_hub` writes this package's model card (rendered by `looped_training.publish` from the run's record and
evaluation, as `python -m looped_training.publish` does) instead of transformers' generic one. Without the training
package installed, transformers' own `push_to_hub` runs. Kept free of package-level imports, so that the copy
`save_pretrained` makes beside the modeling file (trust_remote_code) imports as it is."""


class FPRMHubMixin:
    """Put before `PreTrainedModel` in the bases: `class FPRMPreTrainedModel(FPRMHubMixin, PreTrainedModel)`."""

    def push_to_hub(self, repo_id, *, commit_message=None, commit_description=None, private=None, token=None,
                    revision=None, create_pr=False, max_shard_size="50GB", tags=None):
        kwargs = dict(commit_message=commit_message, commit_description=commit_description, private=private,
                      token=token, revision=revision, create_pr=create_pr, max_shard_size=max_shard_size, tags=tags)
        try:
            from looped_training.publish import push_to_hub_with_card
        except ImportError:  # the model package alone (or the trust_remote_code copy)
            return super().push_to_hub(repo_id, **kwargs)
        return push_to_hub_with_card(self, repo_id, **kwargs)
