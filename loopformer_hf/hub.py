"""`LoopFormerHubMixin`: with looped_training installed, its `ModelCardMixin` (one home for both models), whose
`push_to_hub` writes this package's model card; without it (this package alone, or the copy trust_remote_code loads)
nothing, and transformers' own `push_to_hub` runs."""

try:
    from looped_training.publish import ModelCardMixin as LoopFormerHubMixin
except ImportError:

    class LoopFormerHubMixin:
        pass
