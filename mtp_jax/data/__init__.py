"""The data: tokenizers, corpora (the Python standard library, user files, synthetic
induction tasks) and the grain pipeline that packs documents into batches.

- tokenizers.py: byte, SentencePiece and Hugging Face tokenizers; `resolve_vocab_size`.
- stdlib_dataset.py, corpus.py: the standard-library corpus (a TFDS builder) and its files.
- user_data.py: jsonl / parquet / text-file / `save_to_disk` sources.
- induction.py: synthetic copy and name-story tasks.
- pipeline.py: packing, batching and the iterators the trainer reads.
- checks.py: data checks run before anything compiles.

Public names load lazily: importing one light module here (a command does, before JAX
starts) imports none of its heavy siblings.
"""
from mtp_jax.exports import lazy

__getattr__, __dir__, __all__ = lazy(__name__, {
    'ByteTokenizer': 'tokenizers',
    'HFTokenizer': 'tokenizers',
    'InductionTask': 'induction',
    'NameStoryTask': 'induction',
    'SentencePieceTokenizer': 'tokenizers',
    'Tokenizer': 'tokenizers',
    'check_document_lengths': 'checks',
    'get_tokenizer': 'tokenizers',
    'make_eval_batches': 'pipeline',
    'make_task': 'induction',
    'make_train_iter': 'pipeline',
    'model_vocab_size': 'tokenizers',
    'prepare_stdlib': 'stdlib_dataset',
    'resolve_vocab_size': 'tokenizers',
    'train_tokenizer': 'tokenizers',
    'validate_data': 'checks',
})
