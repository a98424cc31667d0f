"""`cleaner curate` (docs/architecture.md §16): which prompts to train on, by their pass rates, as the
paper curates its dataset. stats.py reads and writes the pass statistics (the paper's JSON Lines) and
keys them to dataset rows; ratios.py parses the retention ratios per success rate; filtering.py
matches rows, classifies data sources and draws the kept prompts; summary.py states the counts;
job.py reads the warehouse or a file and writes the outputs."""
