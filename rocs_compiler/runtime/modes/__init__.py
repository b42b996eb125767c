"""Programs for other modes of a call: a training compile in eval mode, calls under autocast."""
