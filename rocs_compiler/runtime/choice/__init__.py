"""The measured choice between two exact programs per bucket of calls: decisions, trials."""
