package sched

// FinishReason says why a sample ended.
type FinishReason string

// Finish reasons.
const (
	FinishStop   FinishReason = "stop"   // a stop token was produced (it is included)
	FinishLength FinishReason = "length" // max_tokens was reached
	FinishAbort  FinishReason = "abort"  // the request was aborted or the engine stopped
	// FinishError: the model's logits for this sample could not be sampled
	// (NaN or +Inf, or all -Inf); Sample.Err says where. The request's other
	// samples are aborted; the engine and other requests go on.
	FinishError FinishReason = "error"
)

// SamplingParams are a request's sampling settings.
type SamplingParams struct {
	Temperature float32 // 0: greedy
	TopP        float32 // (0, 1]; 0 means 1
	TopK        int     // 0: all
	MaxTokens   int     // >= 1
	Stop        []int32 // stop token ids
	Seed        uint64
	// RoutedExperts asks for the expert ids each generated token's forward
	// pass routed to, per layer.
	RoutedExperts bool
}

// Request is one prompt with N samples.
type Request struct {
	ID     string
	Prompt []int32
	N      int
	Params SamplingParams
}

// Sample is one finished sample of a request.
type Sample struct {
	Index    int
	Tokens   []int32   // generated tokens
	LogProbs []float32 // of each token under softmax(logits / T)
	Versions []uint64  // the policy version each token was produced under
	Finish   FinishReason
	// Routed[i][layer*k + j]: the experts of the forward pass that produced
	// token i (RoutedExperts only).
	Routed [][]int32
	// Err says why a sample ended with FinishError.
	Err string
}

// SampleRow is the sampling setup of one logit row.
type SampleRow struct {
	Temperature float32
	TopK        int32
	TopP        float32
	Seed        uint64
	SampleID    int32 // the sample's index within its request
	Position    int32 // the position of the token being drawn
}

// Unsampled is the token a sampler reports for a row it could not draw
// from (kernels.UnsampledToken).
const Unsampled = -1
