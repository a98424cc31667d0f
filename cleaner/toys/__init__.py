"""`cleaner bootstrap`: the tiny default policy (docs/architecture.md §11).

corpus.py builds synthetic tool-using trajectories, tokenizer.py the byte-level BPE and chat
template, sft.py the model and its supervised training; local_exec.py runs the corpus's own (trusted) code
in one process with the sandbox's user-code runner.
"""
