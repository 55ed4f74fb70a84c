"""The SpecPilot decoder: AR baseline, drafters, verification, profiling and the demo recipe."""

import warnings

# transformers 5.2x renames `past_key_values` to `cache` (removal in 5.40); the GPU machine's 5.17
# knows only the old name, so the decoder keeps it and silences the notice.
warnings.filterwarnings("ignore", message=r".*`past_key_values` is deprecated.*", category=FutureWarning)
