"""`cleaner export` (docs/architecture.md §15): collected iterations as training data for other
trainers. job.py reads the warehouse; policy.py loads the collecting policy's tokenizer and chat
template; conversation.py turns trajectories into chat messages and checks them against it;
rows.py builds each format's rows (conversations, SAAR's chain pairs, outcome pairs); folder.py
writes the shards and card.py the dataset card."""
