"""vLLM's offline-inference quickstart, run on verispec: only the import differs (and the
speculative_config line, which vLLM takes too). MAX_TOKENS in the environment caps the
length (the test uses it); vLLM's default is 16 tokens, verispec's 256.
"""
import os

from verispec import LLM, SamplingParams

prompts = [
    "Hello, my name is",
    "The president of the United States is",
    "The capital of France is",
    "The future of AI is",
]
sampling_params = SamplingParams(temperature=0.8, top_p=0.95,
                                 max_tokens=int(os.environ.get("MAX_TOKENS", "16")))

llm = LLM(model="smollm2-135m-instruct",
          speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4})

outputs = llm.generate(prompts, sampling_params)

for output in outputs:
    prompt = output.prompt
    generated_text = output.outputs[0].text
    print(f"Prompt: {prompt!r}, Generated text: {generated_text!r}")
