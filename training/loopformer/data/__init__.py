"""LoopFormer data: the synthetic multi-hop reasoning corpus, text files/datasets, and the byte-level BPE tokenizer."""
