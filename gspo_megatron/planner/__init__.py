"""Layout planner: which TP/PP/EP/CP layout and token budget fit a model on a cluster (cli `plan`)."""
