"""Adaptive draft length: pick k per request from online acceptance and measured cost.

Pure Python (no torch, no model code), so it is unit-tested alone by simulation.

Terms
-----
k            draft tokens asked of the proposer for one row in one round; k = 0 is plain
             decoding (one target token, no proposer call).
width        tokens per row in the target's verify pass, k + 1 (the last committed token
             plus k drafts). A round commits the accepted draft prefix plus one target token
             (recovered or bonus), so a round yields between 1 and k + 1 tokens.
alpha        per-position acceptance: the probability that a draft position is accepted
             given that all earlier ones were (the geometric model of Leviathan et al.).
rate         committed tokens per second. With E(alpha, k) = (1 - alpha^(k+1)) / (1 - alpha)
             expected tokens per round and T(B, k) the seconds of one round at batch size B,
             a row's rate at k is E(alpha, k) / T(B, k).

Acceptance estimate (per request, decaying per token)
-----------------------------------------------------
A round that drafted d tokens and accepted the first a of them observed a acceptances and,
if a < d, one rejection at position a + 1. Positions a + 2 .. d were never tested: they are
censored, not rejected. The round's likelihood is alpha^a (1 - alpha)^[a < d], so the
sufficient statistics are s = a successes over n = a + [a < d] trials, and the maximum
likelihood estimate over rounds is sum(s) / sum(n). Whether a position is tested depends
only on earlier outcomes (a stopping rule), so every tested position is a Bernoulli(alpha)
draw given the past: E[sum(s)] = alpha * E[sum(n)] (Wald), the estimating equation
sum(s) - alpha * sum(n) has mean zero, and the estimate is consistent with bias
O(1 / window). Two tempting alternatives are biased:
  * accepted / drafted counts censored positions as rejections and reads low
    (alpha = 0.9, d = 8 gives E[a] / d = 0.64);
  * an EWMA of each round's ratio s / n, one step per round, is biased (E[s / n] != alpha
    when d > 1) and its window is a number of rounds, so it shrinks to a handful of tokens
    whenever k collapses to 1 -- the estimate turns noisy exactly when k is small and the
    controller oscillates.
So the sums decay per tested position: each trial multiplies the old weight by
2 ** (-1 / alpha_half_life_tokens), and the window is the same number of tokens whatever k
is. A round with n trials decays the old sums by that factor ** n and adds (s, n) at
equal weight (the order of outcomes inside a round carries no information).

A round with drafted = 0 (k = 0, or n-gram found no match) tested nothing: it adds no
trial, and in particular no rejection. But a request parked at k = 0 learns nothing, so it
would never notice its acceptance rising (measured: on a workload alternating between
alpha 0.9 and 0.35 the controller then gains 2% over the best fixed k instead of 11%). So an untested round
counts as a chance, 1 - 2 ** (-1 / idle_half_life_rounds), that the request's acceptance
has changed to a draw from its proposer's global estimate: the estimate moves that fraction
toward the global one, and its weight toward the prior's (see "Prior"). A parked request so
drifts toward what the workload shows and eventually drafts again; if its acceptance is
still low, that round's evidence sends it back. The controller notices untested rounds
itself: a request passed to choose_k that reports no drafted position before its next
choose_k (k = 0, no n-gram match, k clamped by the engine) gets one such step, whether or
not the engine reports drafted = 0 (which is accepted and records nothing).

Each request starts from its proposer's global estimate, and every observation also feeds
that global estimate (with a longer half-life), so new requests start from what the
workload has shown rather than from a constant.

Prior (how much the global estimate is worth to a request)
----------------------------------------------------------
How many trials the global estimate counts for in a new request (and in a parked one's
relaxation) is a question of how alike the requests are, so it is measured, as empirical
Bayes does: over the proposer's finished requests (decayed, half-life
`spread_half_life_requests`), the variance of their acceptance rates (accepted / tested
positions) less the part their own binomial noise explains, p (1 - p) / n_i on average,
leaves tau^2, the spread between requests; the prior is worth p (1 - p) / tau^2 trials (the
sample size at which a request's own estimate is as uncertain as the spread), within
[`prior_weight_tokens`, `prior_weight_max`], and `prior_weight_tokens` until 3 requests have
finished. Alike requests (math prompts, all near 0.45) then lean on the global estimate for
most of a short answer instead of steering by their first dozen trials: at batch 1, with a
coin-toss first draft and drafting worth ~1.15x, each request's own estimate ranged 0.28-0.55
(deciles) around a true 0.45, and the noise alone cost 3-4% against the best fixed k
(bench/controller_sim.py's "alike short requests", after a warm-up that read low: 0.967 ->
0.974 of the best fixed k over 20 seeds; 0.969 -> 0.975 with a warm-up that read right).
Requests unlike each
other (quoting at 0.9 beside chat at 0.2) keep the minimum, so each still finds its own
acceptance within a few rounds.

First draft and continuation
----------------------------
One alpha says every position is accepted alike. N-gram drafts are not: the first token of
a lookup is a coin toss and, once it is right, the continuation usually is
(bench/acceptance_profile.py, default model, every task: position 1 accepted 0.32-0.51 of
the time, positions 3+ 0.67-1.0 given the earlier ones; inside single requests too). One
alpha fitted to that reads low when a request plays k = 1 (it tests position 1 almost
only), and at that alpha k = 1 and k = 2 rate alike, so the request stays at k = 1 where
k = 2 pays ~8% more at batch 1. So each request also keeps two parts, estimated as alpha
is (the same censoring, on the same per-token clock): the first draft's acceptance, and
the continuation's (positions 2.. given the first accepted). A part's value is its data
with the request's pooled alpha as the prior, worth as many trials as a new request's
prior (`prior_weight_tokens`, more where finished requests were alike: see "Prior"), taken
relative to that alpha and applied to the alpha as shrunk across the batch (see
`_pooled_alphas`): with no data of its own (a request that never drafted past position 1)
a part is the pooled alpha, and the model is the geometric one. The row's i-th draft then
adds first * cont^(i - 1) expected tokens (non-increasing in i, as the batch plan needs).
Simulated: first 0.4, then 0.85, n-gram costs of this CPU at batch 1: 0.974x the best fixed
k, against 0.953x with one alpha (k = 1 throughout); geometric workloads within 0.5% of
before. `alpha()` and the 0.02 accuracy claim above stay the pooled estimate.
(At `prior_weight_tokens` whatever the spread, one rejected continuation parked a draft
model's request at k = 1: Qwen2.5-Coder code at 1 in flight, acceptance ~0.98, a trace.
Its first round drafted 6 and the third was rejected, its continuation read
0.88 against 8 trials, a draft of 1 priced best, and k = 1 tests no continuation, so the
estimate never moved: 30 rounds at 55 ms a token where 6 drafts made 47. With the alike
requests' 64 trials it reads 0.96 and the request drafts deep.)

Match length (what the lookup says about this round's drafts)
-------------------------------------------------------------
How long a suffix an n-gram lookup matched predicts its first draft better than anything
the request's past rounds show: on the default model, every task, a 1-token match's first
draft is accepted 0.15-0.26 of the time, a 2-token match's 0.35-0.60 and a 4-token match's
0.68-0.92, its second draft 0.69-0.96 (bench/acceptance_profile.py --k 4; most matched
rounds, 46-77%, are 1-token ones). One estimate per request averages them: it drafts
on 1-token matches that do not pay and too shallowly on 4-token ones that would. So the
engine passes each row's match length with the lookup (`matches`) and with the round's
acceptance, and the controller keeps first-draft and continuation estimates per proposer
and match length over all requests (on the global estimate's clock, started at it) and per
request and match length (data only, on the request's clock, fading with its other parts
when untested). A row with a match length is priced at its request's data for that length
with the proposer's estimate for it as the prior, worth as many trials as a new request's
prior (see "Prior": more where finished requests were alike). With 8 trials, a request's
first few rejections on 1-token matches stopped its drafting there while its peers' record
said those drafts pay (GSM8K at batch 1, a trace: plain chosen with 8 drafts at hand in 27 of
678 rounds; 5 of 690 with the prior's weight; see
test_a_request_leans_on_its_match_length_estimate_as_much_as_requests_are_alike). Rows
without one (a draft model) keep the pooled model below. Resting (see "Rest") follows: a
round that chose plain decoding while its best match was shorter than the longest seen says
nothing about the next round's long match, so it does not rest.
Simulated (bench/controller_sim.py's "ngram chat match lengths", MT-bench's measured shares
and acceptance per length at batch 1): 1.14x the best fixed k, where ignoring the length
stays below it (test_rows_are_priced_at_their_match_lengths_acceptance); with GSM8K's,
HumanEval's and CNN's shares too, at batch 1 and 4 (scratch runs): 1.00-1.18x against
0.96-0.985x.

Availability (how many drafts a row can get this round)
------------------------------------------------------
A proposer may deliver fewer drafts than asked: n-gram lookup finds no match in most rounds
of open chat, and a match near the end of the history continues for only a few tokens. The
lookup is a cheap CPU operation, so the engine runs it (for k_max tokens) *before* choosing
k and passes each row's `available` count: the controller then knows exactly what drafting
can buy this round instead of estimating it. A draft model always delivers what it is asked
(available None: up to k_max). Estimating instead (a decayed drafted / asked per request,
what this controller did before) priced rounds by past coverage while this round's rows
might all have matches, or none, and drafted on chat at batch 16 at 0.94x plain decoding
(bench/adaptive.py at commit 6b45364).

Costs (measured, never assumed)
-------------------------------
The engine reports the seconds of every decode round, keyed by the batch size and the
number of draft tokens the pass verified, summed over rows (0 = plain decoding): the whole
step but the draft pass and the choice (the lookup and choose_k, timed apart: see "Rest"),
so scheduling, sampling and bookkeeping, which grow with the drafts too, are priced with the
verify forward (timing the forward alone made drafting look cheaper than it is at batch
16). Linear layers run over the batch's tokens flattened (no padding) and attention groups rows by query length, so the pass's work
follows its total tokens, not its widest row: 15 rows decoding one token and one row
verifying 4 drafts cost about as much as 20 single-token rows. The draft model's pass is
reported separately, keyed by the rows it drafts for (its own batch) and the deepest row's k
(it runs k steps); a plan is priced at the draft rows it gives drafts to. (Keyed by the
round's batch instead, one cell mixed passes for 1 and for all 4 drafting rows at 4 in
flight, and drafting every row looked as cheap as drafting one.)
Batch sizes and draft tokens are bucketed alike: exact up to 8, then 4 buckets per octave;
each cell keeps its last `cost_window` timings and estimates the pass by their mean,
leaving out any timing above `cost_spread` (1.25) times their median: a stall or a pause
(another process, a page fault) is not the pass's cost, and it lands in one cell only.
(With an EWMA, one plain round at batch 4 that took 3.3x the others, 0.068 s against
~0.020 s, raised the plain cell by a quarter; drafting then looked cheaper than plain, and
the controller drafted in 10 of the next 13 rounds at 2-3x a plain step each: chat at 4 in
flight, default model, n-gram. With the cut at `cost_outlier`, 2x, two pauses of 1.86x in
the window of the 16-row plain cell lifted it from 18.8 to 20.1 ms, and 1-draft rounds at
~20 ms, a loss, looked 5% faster than plain: 43 of 147 rounds at 16 rows drafted, chat at
16 in flight, a solo trace. A sustained change of pace is not cut for long: the machine's
pace moves every cell, below, and a cell's median follows a change within half a window.)
The window tracks drift within half its length, as the median moves. An unmeasured cell
is estimated from the measured ones as the tightest lower bound implied by two physical
assumptions: cost never falls when the batch or the tokens grow, and cost per row or per
token never grows with them (a fixed overhead plus at most linear work). For a measured
cell (b', n') with cost c that gives
    cost(b, n) >= c * min(1, b / b') * min(1, size(b, n) / size(b', n')),
where size is the pass's tokens (b + n for verify, n for the draft model's k steps), and
the estimate is the largest such bound. Past the widest trusted pass of its batch bucket a
third assumption tightens it: cost is convex in tokens (a fixed part while memory-bound,
then a per-token part), so it lies above the secant through the narrowest and widest
trusted drafting passes narrower than it, continued (each end moved two standard errors of
its mean toward the other, so timing noise between close sizes does not read as a slope).
Without it a 4-row pass of 28 drafts was priced at its 12-draft neighbour's 26 ms, took
50 ms, and was probed three times in one run (default model, code, 4 in flight). With one
such pass the trusted plain round is the narrow end, at half the slope (a verifying round's
fixed extra would otherwise read as slope). And the bucket's plain round continues on the
slope from a smaller bucket's plain round (an added row costs about what an added draft
token does, and convexity makes the slope over fewer tokens a lower bound), so a bucket
knows a slope before it has measured any drafting: 16 rows otherwise priced their first 16
drafts at a plain round's 23 ms, on the flat bound, and paid 35-49 ms three times before
the cell was trusted (math, 16 in flight; see `CostTable._secants`). The same two assumptions
give an upper bound: a pass costs no more than a trusted cell with no fewer rows and no
fewer draft tokens (a plain round no more than any such, a verifying one no more than a
verifying one), and no estimate is above it. A plain round is bounded by plain rounds only: a
round verifying drafts does more per token (rejection sampling, KV rollback, the drafts'
bookkeeping), so its time is no lower bound for a plain round of as many tokens. (It was
taken as one: on Qwen2.5-Coder chat at 4 in flight plain decoding at batch 4 was priced at
0.28 s from a round of 2 rows verifying 2 drafts, never measured (it takes ~0.23 s), and
the controller drafted in every round at 0.85x plain.) Because the estimate is never above
the truth it is optimistic, and optimism is the exploration: an unmeasured size is tried
exactly when even its optimistic rate beats the best known one, and is measured by that
round. A cell with fewer than `cost_min_samples` samples counts as no more than that bound
either, so one slow first timing (a page fault, a kernel's first call at a new shape)
cannot price a size out for good. (That costs re-probes: a 16-row pass of 14 drafts priced
at 30 ms was probed three times at 39 ms, math at 16 in flight. Pricing a young drafting
cell at its own mean when within `cost_outlier` of its bound saved them, but lost 0.5% on
the simulated first 0.4 / then 0.85 workload and undid the stale-cell and plain-pricing
safeguards' tests, so it is not done.)

Drift (a slowdown hits every pass alike)
----------------------------------------
A cell moves only when it is visited, but the machine's speed moves for all of them: on
Qwen2.5-Coder chat at 1 in flight a slow stretch (every pass 1.3-2x slower for ~8 rounds)
entered the cell of a 1-draft verify pass (below 2x its median, so kept) and lifted it 13%;
plain rounds then refreshed the plain cell and nothing refreshed the drafting one, so
drafting stayed priced out for the rest of the run (0.90x the best fixed k). So the tables
share one speed factor f. Every cell stores its timings divided by f (speed-free seconds)
and every estimate is its stored mean times the current f. An established cell's timing t
(a full window) is evidence of the pace against c, the robust mean of the cell's earlier
timings of the same pass (exact batch size and draft tokens: a bucket mixes 15- and 16-row
rounds) from before the run of evidence not yet acted on: log(t / (c f)), if t is within
`cost_outlier` of c f either way. When the median of the last 5 such is beyond 10% either
way and beyond 3 standard errors of such a median on the cells' own scatter (a change that
several passes agree on, not noise), f moves by that median (times `cost_drift`) and the
timings that showed it, stored at the old pace, are restated at the new one. A slow stretch
then raises f instead of the one cell visited, and when it ends f comes back and the cells
visited during it read at the normal speed. Decisions compare rates, which a common factor
does not change; only timings of different moments are made comparable. Noise is kept from moving f
as far as it can be (an f that followed every timing, f r^0.5, took on the noise: with batch 1 and 16
alternating in 25-round chunks, 5% noise, the modal k at 16 went from the oracle's 2 to 3).
Simulated (tests): 8 rounds at 1.6x visiting both cells, then 16 plain ones: the drafting
cell ends 30% high without f, 4.5% with it. Young cells do not move f: a cell that spans
several sizes, filled in one sweep of rising sizes, would read as a machine slowing down.
(Formerly the reference was the cell's whole mean, the run of evidence included,
and 10% the only bar. On the Intel VM, whose 16-row rounds wander by 15% in stretches of a
few rounds, f then moved on that wander, down 12-14% in two traced runs of math at 16 in
flight, and the plain cell, visited every round, took the way back into its own mean while f
stayed: every drafting cell read 6-13% cheap for the rest of the run (the traced drafting
rounds took a median 1.06x and 1.13x their estimate; replayed with this reference, 1.006x and
1.005x), and the controller drafted at a loss. Simulated on a steady machine with 10% noise,
f moved 38 times in 600 rounds; now 10.)

Stale cells
-----------
A cell not visited keeps the timings of whenever it was last visited, and plain decoding is
the cell every drafting plan is compared with. In lockstep at 16 in flight (chat) plain
rounds ran 19-20 ms early, 25-31 ms in a slow stretch, then ~23 ms again; the controller
probed 2 drafts at the end of the stretch and from then on compared 2-draft rounds timed at
the fast pace (25-28 ms) with plain priced at the slow one (27.7 ms against a true 23.5): it
drafted in 29 of the last 33 rounds at a loss (the speed factor reads established cells
only, and the drafting cell was young). So (1) while the controller drafts at a bucket whose
plain round was last timed more than 2 `cost_window` passes ago, and plain's estimated rate
is within `explore_within` of the chosen plan's, it plays one plain round instead (at most
one round in 32 at a price within 15%: < 0.5% where drafting pays); and (2) a cell visited
after more than 2 `cost_window` passes without one holds only the fresh timing: the old ones
are of another stretch of the run, and a fresh timing is unbiased where their mean is not
(a cell that is then chosen gathers samples again; one visited only now and then is priced
by its latest timing).

Exploring from a cold start costs real rounds, and at batch 16 one round of 8 drafts per
row costs ~4 plain steps (measured). So the controller widens step by step: with nothing
measured it plays plain decoding; a verify pass may hold at most twice the tokens of the
largest pass measured at its batch bucket (batch 1: 1, 3, 7, 15 drafts; batch 16: 16, 48,
...), and a draft model may run at most one step deeper than the deepest draft pass
measured (each step is a sequential forward of the draft model; before this rule a cold
controller on Qwen2.5-Coder chat at 4 in flight went from depth 1 to 3 to 7 in its first
rounds, its optimistic bounds flat from depth 1). The bounds then only ever reach one step
past what is known. Because a cell only moves when it is visited, a small deterministic schedule (a fraction `explore` of rounds) also
re-measures the neighbouring size of the chosen one that was measured longest ago, when its
estimated rate is within `explore_within` of the best (a far-behind neighbour is not worth a
round at its price; if acceptance rises, the estimates bring it back into play anyway). A
probe never starts a row drafting (a catch-up, see "Catch-ups"): it re-measures a pass, and
a catch-up is not a pass but a stake spent for good, on a plan estimated to lose. (At the
end of a drain one row's catch-up costs several plain rounds: Qwen2.5-Coder chat at 4 in
flight, 65 tokens in 0.47 s against 0.11 s plain rounds. That one was the best plan's, a bet
at acceptance 0.74 that drew two rejections; a probe's would have been a worse one.)

Exploration budget (what exploring may cost)
-------------------------------------------
Optimism explores, and each exploring round is a bet: at 16 in flight on Qwen2.5-Coder chat
a cold controller played 10-15 drafting rounds of 1-2 s against ~1.1 s plain ones before
its cells were measured, 8-10% of a cell of 64-token answers that nothing amortised. So
the controller keeps a ledger. A plan is trusted when every pass it is priced by has a
trusted cell (and a catch-up in it has a measured price); plain decoding always is. A
round whose plan is not trusted explores, and its debt is what it cost beyond the best
trusted plan: its seconds (draft and verify passes as measured) minus its committed
tokens (one per row plus the accepted drafts, as reported) over that plan's estimated
rate. A catch-up enters as the share of it the plan priced (see below: spread over the
tokens it enables), not at once: it is an investment in the rest of the answer, and
entered whole it cost a cold controller on Qwen2.5-Coder code at 1 in flight (where
drafting is worth 1.6x) ~5% of an answer in one round, which shut drafting out for good.
An exploring round that beat the trusted plan pays its debt back. A round is charged at
most `cost_outlier` times what its plan was priced at: a timing above that is a stall (the
cost tables leave it out for the same reason), and a stall is not what exploring cost. (A
first pass at a new size timed at 5x its cost, a page fault or a kernel's first call at a
new shape, otherwise ran up a debt of ~3.5 plain rounds that kept a 1.5% budget spent for
the next ~230, and drafting, worth 3.6x there, off for all of them.) The controller
explores only while the debt is at most `explore_budget` of all the rounds' seconds, and
otherwise plays the best safe plan: the best rate at prices a plan cannot exceed, its
trusted cells' or, for an unmeasured pass, the upper bound from trusted ones (above).
Exploration then costs at most that fraction of the run, plus one round. (With trusted
plans only, a spent budget kept 3 rows at plain decoding for 58 rounds after a 4-row
batch lost a row, though the 4-row pass with 4 drafts, measured, showed that drafting
paid: code, 4 in flight.) Exploration that pays (drafting at batch 1) funds
itself; exploration that loses waits until the run has earned it. (Simulated: 16 rows of
64 tokens where drafting never pays, a cold controller 0.94x plain without the budget,
0.970x with 3%, 0.974x with 1.5%.)
Each batch bucket also keeps a ledger of its own, and an untrusted plan is played only
while the bucket's debt too is within the budget of the bucket's own seconds. The run's
budget alone was earned at 16 rows and spent in the drain: as the closed loop's last
requests finish the batch passes through smaller buckets with no drafting cells, whose wide
passes are bounded only by the 16-row cells scaled down by rows, and each explored them
(chat at 16 in flight, a trace: 23 drafts at 11 rows priced 26 ms took 40; 16 at 6 rows
priced 14 took 24; eight such rounds in ~30), where the drain read 0.92-0.95x plain in four
tasks of five and the plain control 0.99-1.02x. A bucket's first exploring round is free
(its debt 0), so each still explores once; one that pays funds the next.

Catch-ups (a draft model's one-off cost)
----------------------------------------
The draft model's KV is filled lazily: a row that has not drafted for a while (or ever: its
prompt) must first catch up on the tokens its draft KV lacks, one multi-token pass whose
cost is paid once and then enables drafting for the rest of the request. The engine passes
each row's missing tokens (`catch_up`) and remaining output budget (`remaining`), and
reports catch-up passes (kind "catch_up", seconds and tokens), from which the controller
prices a token: the last `cost_window` catch-ups' seconds over their tokens, a stall left
out as in the cost cells, and from fewer than `cost_min_samples` the cheapest a token among
them. (A decayed mean, as before, held a stall for many catch-ups, and held a first,
possibly cold, timing: a price too high keeps new requests plain, and a request that stays
plain measures no catch-up that could correct it.) Starting to draft on row r then costs
its catch-up, spread over the tokens it enables: a round that yields E(alpha_r, k_r) tokens
of the row's remaining_r is charged c_r * s_tok * E(alpha_r, k_r) / remaining_r, added to
the pass's cost for every row the plan gives drafts to. remaining_r is what the row is
expected still to make: its budget left, or less where the proposer's requests end early.
Over the finished ones (decayed, half-life `spread_half_life_requests` requests, read from
3 on), h is their early ends (EOS, a stop string) per generated token, a request that ran
its budget out adding its tokens and no end; a constant chance h of ending at each token
leaves (1 - (1 - h)^b) / h of a budget b. (Over the budget itself: Qwen2.5-Coder chat at 1
in flight, answers of 45 of their 64 tokens on average, each catch-up priced at 0.7 of its
share, and adaptive drafted as a fixed k = 1 does, 0.961x plain against k = 1's 0.954x.) (Charging the catch-up at the row's cap instead of E overcharged a plan at
depth 1 4x, and a cold controller never drafted at 4 in flight.) At 16 in flight with
64-token answers to ~150-token prompts (Qwen2.5-Coder pair), a draft model that catches
every row up paid more than drafting saved (0.85x plain at acceptance 0.98). Before any
catch-up has been measured at most one row that needs one may draft per round (the one
missing the fewest tokens): its pass measures the price before the other rows pay it. And a
catch-up is spent for good, while exploration runs on optimistic prices (an unmeasured pass
is priced at its lower bound): so a plan in which more than one row starts drafting
(catches up on more than k_max tokens) is considered only when its verify and draft cells
are measured (trusted); otherwise rows start one per round, each start measuring a wider
pass. (On Qwen2.5-Coder chat at 16 in flight, a cold controller started 8 rows on the bound
of a 16-row pass verifying 16 drafts, 0.52 s, that took 0.9 s: 723 tokens of catch-up, 5.2
s, bought on a price that was off by 2x, and again for 13 rows a few rounds later.)

Rest (what choosing costs)
--------------------------
Choosing is not free: the n-gram lookup and choose_k take 0.2-0.55 ms of a step on the
default model (0.18 ms of a 6.5 ms step at 4 rows; at 16, 0.19-0.26 + 0.31 ms of a 21 ms
step on Zen 4), and a round that chooses pays it whatever it chooses, so a controller that
chose every round would never see that a plain engine's round is 1.5-3% cheaper than its
plain round (lockstep traces). Where plain decoding wins (16 in flight, most
tasks) that is most of what a 0.97 target allows. So a controller that chose plain for
every row while some had drafts at hand (as the best plan, not as a probe or a stale cell's
re-timing in the middle of drafting) rests: the engine skips the lookup and the choice for
its adaptive rows for the next 1 round, then 2, 4, ... up to `rest_max` while it keeps
choosing plain, and back to choosing every round as soon as it drafts. A rest round is a
plain round (k = 0 for those rows, counted as chosen, their acceptance relaxed as for any
untested round). What it can cost: a workload that turns in drafting's favour is seen up to
`rest_max` rounds late.
So the choice is a price of drafting: the engine times it apart (kind "choice", per batch
bucket, a decayed mean) and leaves it out of the verify timing, and every drafting plan is
priced with it added, plain without it (choosing plain with drafts at hand leads to rest).
With the choice inside the verify cells instead, the plain cell held mostly resting rounds
and the drafting cells every choice, so an unmeasured drafting pass, bounded from plain
cells, was priced ~0.5 ms (2.5%) cheap at 16 rows, and a measured one compared with plain
through a slope that read the choice as per-token work.

Hold (choosing less often while drafting)
-----------------------------------------
Drafting chooses every round, and the choice is what drafting loses to the best fixed k
where the best plan does not change: at 1 in flight on math (default model, Sapphire Rapids
VM) choose_k took 80 us of a 4.6 ms step solo and ~1.5x that in lockstep, and the adaptive
cell missed the best fixed k by 3% with decisions that matched it. So a batch
whose choice priced its plans and picked the same drafting plan as its last such choice
(same rows in the same order, same batch size, the same k for each row), the best plan on
trusted cells (not a probe, an exploration or a stale cell's re-timing) and no row's k set
by its cap (a row whose lookup had fewer drafts than it would take says nothing of what it
would take next round; k_max excepted), holds: its next 1, then 2, 4, ... up to `hold_max`
rounds replay that plan without pricing, each row drafting at most what it has at hand that
round, a round without any drafts at hand passing by as it would. Any other batch, or a
round a probe is due on, chooses, and the hold ends; a choice of another plan starts the
doubling over. A held round is counted as chosen (and as a round for the probes' cadence),
its acceptance reported as any round's, and its verify pass enters the cost cells as any;
the engine's choice timing of it (the lookup and the replay) enters the choice's mean, so
drafting is priced with what its choosing costs on average. What it can cost: a change in
acceptance or cost is acted on up to `hold_max` rounds late (4 rounds at the default, against
a 20-token half-life of acceptance).

The batch (one verify pass serves every row)
--------------------------------------------
All rows of a step share one verify pass, whose cost follows its total draft tokens D. The
k-th draft of a row adds alpha_r^k expected tokens (E(alpha, k) - E(alpha, k - 1)), which
falls with k, so for a given D the best use of the pass is the D largest of these marginal
gains over all rows (each row within what it has available): a prefix of each row's
positions, row r's k being the number of its gains taken. The controller picks
    D = argmax_D (B + sum of the D largest gains) / (T_verify(B, D) + T_draft(B, K)),
evaluating one D per cost bucket (within a bucket the cost is the same and more gains only
help), where K is the deepest row's k when a draft model drafts (it runs K steps; each cap
K in [1, k_max] is tried), T_draft is priced at the rows drafting among the D, and
T_draft = 0 for n-gram. A batch of alike requests spreads the
drafts evenly (all rows at the same k when D is a multiple of B); a row whose acceptance is
low, or whose lookup found nothing, drafts less or not at all while the others draft, and
costs the pass nothing. At batch 1 this is exactly argmax_k E(alpha, k) / T(1, k).
"""
from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from collections import deque
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from itertools import islice
from operator import itemgetter

# Proposers whose drafting is a CPU lookup: no draft pass, no draft cost.
FREE_DRAFT_PROPOSERS = frozenset({"ngram"})
COST_KINDS = ("verify", "draft", "catch_up", "choice")
_MIN_SECONDS = 1e-12  # guards a rate against a measured 0 s (coarse timers)
_NO_WEIGHT = 1e-9    # a prior worth nothing (an estimate of data only, never 0 / 0)


def expected_tokens(alpha: float, k: int) -> float:
    """Expected committed tokens of a round drafting k tokens: (1 - alpha^(k+1)) / (1 - alpha)."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    # The sum 1 + alpha + ... + alpha^k is exact at alpha = 1, where the closed form is 0/0.
    return sum(alpha ** i for i in range(k + 1))


def batch_bucket(batch_size: int) -> int:
    """The bucket of batch sizes that costs are keyed by: exact up to 8, then 4 per octave
    (as `size_bucket`). Not powers of two: on Qwen2.5-Coder-1.5B (bf16, 2 threads) a plain
    round costs 0.28 s at batch 4 and 0.235 s at batch 3, and one cell for both priced
    plain at 3 rows by the 4-row rounds it had measured, against drafting measured at 3."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    return size_bucket(batch_size)


def size_bucket(n: int) -> int:
    """The bucket of a pass's draft tokens (or depth): exact up to 8, then 4 per octave
    (9-10 -> 10, 11-12 -> 12, ..., 17-20 -> 20); the bucket is its largest member."""
    if 0 <= n <= 8:  # (first: the controller's inner loop asks for these most)
        return n
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    step = 1 << ((n - 1).bit_length() - 3)
    return -(-n // step) * step


@dataclass(frozen=True)
class ControllerConfig:
    """How the draft length is chosen. Built once, never mutated."""

    k_max: int = 8                     # largest k ever chosen for a row
    adaptive: bool = True              # False: every row drafts fixed_k
    fixed_k: int = 4
    # Starting per-position acceptance per proposer name; the keys are the allowed proposers.
    prior_alpha: dict[str, float] = field(
        default_factory=lambda: {"ngram": 0.5, "draft": 0.7}, hash=False)
    alpha_half_life_tokens: float = 20.0   # per-request window, in tested draft positions
    prior_weight_tokens: float = 8.0       # trials a new request's prior is worth, at least
    prior_weight_max: float = 64.0         # ... and at most, when its proposer's finished
                                           # requests show alike acceptance (docstring "Prior")
    spread_half_life_requests: float = 32.0  # finished requests that show how requests differ
                                             # (and how soon they end: docstring "Catch-ups")
    prior_half_life_tokens: float = 1024.0 # window of the per-proposer global estimate
    idle_half_life_rounds: float = 32.0    # untested rounds for a request to forget halfway
    cost_window: int = 16                  # timings a cost cell keeps (its robust mean's window)
    cost_outlier: float = 2.0              # a timing above this times its cell's median is a stall
    cost_spread: float = 1.25              # ... and above this it is left out of the cell's mean
                                           # (a pause, not the pass: docstring "Costs")
    cost_drift: float = 1.0                # share of a detected change of the machine's pace
                                           # applied to every cell (0: none; docstring "Drift")
    cost_min_samples: int = 3              # a cell's samples before it is trusted above the bounds
    explore: float = 0.03                  # fraction of rounds that re-measure a neighbour size
    explore_within: float = 0.15           # ... if its estimated rate is within this of the best
    explore_budget: float = 0.015          # exploring rounds' cost beyond the trusted best, as a
                                           # fraction of all measured round time (docstring)
    rest_max: int = 8                      # rounds a controller that chose plain with drafts at
                                           # hand may rest (no lookup, no choice), doubling from 1
                                           # while it keeps choosing plain; 0: never (docstring "Rest")
    hold_max: int = 4                      # rounds a batch that chose the same drafting plan twice
                                           # running may replay it without choosing, doubling
                                           # from 1; 0: never (docstring "Hold")

    def __post_init__(self):
        # Copy so a caller mutating its dict cannot change a built config.
        object.__setattr__(self, "prior_alpha", dict(self.prior_alpha))
        if not isinstance(self.k_max, int) or not 0 <= self.k_max <= 64:
            raise ValueError(f"k_max must be an int in [0, 64], got {self.k_max!r}")
        if not isinstance(self.fixed_k, int) or not 0 <= self.fixed_k <= self.k_max:
            raise ValueError(f"fixed_k must be an int in [0, k_max={self.k_max}], got {self.fixed_k!r}")
        if not self.prior_alpha:
            raise ValueError("prior_alpha must name at least one proposer")
        for name, a in self.prior_alpha.items():
            if not 0.0 <= a < 1.0:
                raise ValueError(f"prior_alpha[{name!r}] must be in [0, 1), got {a}")
        for name in ("alpha_half_life_tokens", "prior_weight_tokens", "prior_half_life_tokens",
                     "idle_half_life_rounds", "spread_half_life_requests"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if not self.prior_weight_max >= self.prior_weight_tokens:
            raise ValueError(f"prior_weight_max must be >= prior_weight_tokens={self.prior_weight_tokens}, "
                             f"got {self.prior_weight_max}")
        if not isinstance(self.cost_min_samples, int) or self.cost_min_samples < 1:
            raise ValueError(f"cost_min_samples must be an int >= 1, got {self.cost_min_samples!r}")
        if not isinstance(self.cost_window, int) or self.cost_window < 1:
            raise ValueError(f"cost_window must be an int >= 1, got {self.cost_window!r}")
        if not self.cost_outlier >= 1.0:
            raise ValueError(f"cost_outlier must be >= 1, got {self.cost_outlier}")
        if not 1.0 <= self.cost_spread <= self.cost_outlier:
            raise ValueError(f"cost_spread must be in [1, cost_outlier={self.cost_outlier}], got {self.cost_spread}")
        if not 0.0 <= self.cost_drift <= 1.0:
            raise ValueError(f"cost_drift must be in [0, 1], got {self.cost_drift}")
        if not 0.0 <= self.explore < 1.0:
            raise ValueError(f"explore must be in [0, 1), got {self.explore}")
        if not 0.0 <= self.explore_within <= 1.0:
            raise ValueError(f"explore_within must be in [0, 1], got {self.explore_within}")
        if not self.explore_budget >= 0.0:
            raise ValueError(f"explore_budget must be >= 0, got {self.explore_budget}")
        if not isinstance(self.rest_max, int) or self.rest_max < 0:
            raise ValueError(f"rest_max must be an int >= 0, got {self.rest_max!r}")
        if not isinstance(self.hold_max, int) or self.hold_max < 0:
            raise ValueError(f"hold_max must be an int >= 0, got {self.hold_max!r}")

    def to_dict(self) -> dict:
        """Plain data, recorded next to benchmark results."""
        return asdict(self)


class AcceptanceEstimator:
    """Decayed maximum-likelihood estimate of per-position acceptance (see module docstring)."""

    def __init__(self, prior_alpha: float, prior_weight: float, half_life_tokens: float):
        self._decay = 0.5 ** (1.0 / half_life_tokens)  # per tested position
        self.successes = prior_alpha * prior_weight
        self.trials = prior_weight
        self.observed_tokens = 0  # tested positions seen, undecayed
        self.observed_successes = 0  # ... and accepted of them

    def observe(self, drafted: int, accepted: int, clock: int | None = None) -> None:
        """Fold in one round: `accepted` of `drafted` accepted, then one rejection if short.
        `clock`: the tested positions the old sums decay by (default: this round's trials; a
        part of the positions passes the whole round's, so every part keeps one window)."""
        trials = accepted + (1 if accepted < drafted else 0)
        if trials == 0:
            return  # nothing drafted, nothing tested
        keep = self._decay ** (trials if clock is None else clock)
        self.successes = self.successes * keep + accepted
        self.trials = self.trials * keep + trials
        self.observed_tokens += trials
        self.observed_successes += accepted

    def relax(self, prior_alpha: float, prior_weight: float, keep: float) -> None:
        """One untested round: with probability 1 - keep acceptance changed to a prior draw."""
        value = keep * self.value + (1.0 - keep) * prior_alpha
        self.trials = keep * self.trials + (1.0 - keep) * prior_weight
        self.successes = value * self.trials

    def fade(self, keep: float) -> None:
        """`relax` toward the estimate itself at no weight: the value stays, the data fades."""
        trials = keep * self.trials + (1.0 - keep) * _NO_WEIGHT
        self.successes *= trials / self.trials
        self.trials = trials

    @property
    def value(self) -> float:
        """The estimate: decayed successes over decayed trials."""
        return self.successes / self.trials


class CostTable:
    """Seconds of one pass kind per (batch bucket, size bucket), with optimistic estimates.

    A cell keeps its last `window` timings (only the fresh one when it was unvisited for
    `STALE_AFTER_WINDOWS` windows of passes); its estimate is their mean over the timings
    within `spread` times their median (see the module docstring: robust to a pause); a
    timing within `outlier` of the pace expected is evidence of the machine's pace (`_Speed`).
    `tokens(bucket, size)` is the work measure the bounds scale by: b + n for a verify pass
    over n draft tokens, n for the draft model's n steps. `plain_by_plain`: a pass of size 0
    is bounded by measured cells of size 0 only (a verifying round does more per token).
    """

    PLAIN_SLOPE_SHARE = 0.5  # of the slope from a plain cell (see `_secants`)
    CARRIED_SLOPE_SHARE = 1.0  # of the slope between two buckets' plain cells (see `_secants`)
    STALE_AFTER_WINDOWS = 2  # a cell unvisited for this many windows of passes restarts (`observe`)

    def __init__(self, window: int, tokens, min_samples: int = 1, plain_by_plain: bool = False,
                 outlier: float = 2.0, speed: "_Speed | None" = None, spread: float = 1.25):
        self._window = window
        self._outlier = outlier
        self._spread = spread
        self._speed = speed if speed is not None else _Speed(0.0)
        self._tokens = tokens
        self._plain_by_plain = plain_by_plain
        self._prepared: dict[int, _Bucket] = {}  # bucket -> its view of the cells (`_bucket`)
        self._uppers: dict[int, tuple[list, list]] = {}  # bucket -> its upper bounds (`_upper`)
        self._min_samples = min_samples
        self._cells: dict[tuple[int, int], _Cell] = {}  # (bucket, size bucket) -> cell
        self._widest: dict[int, int] = {}               # bucket -> largest size measured

    def observe(self, batch_size: int, size: int, seconds: float, stamp: int) -> None:
        """Fold one measured pass into its cell."""
        bucket = batch_bucket(batch_size)
        key = (bucket, size_bucket(size))
        self._widest[bucket] = max(self._widest.get(bucket, 0), size)
        cell = self._cells.get(key)
        if cell is None:
            cell = self._cells[key] = _Cell(deque(maxlen=self._window), deque(maxlen=self._window))
        # Unvisited for more than two windows of passes: its timings are of another stretch of
        # the run, and the fresh one replaces them (see "Stale cells").
        stale = cell.count > 0 and stamp - cell.stamp > self.STALE_AFTER_WINDOWS * self._window
        if stale:
            cell.samples.clear()
            cell.passes.clear()
        speed = self._speed
        # established cells only, and not a stale one (its old mean is not this moment's pace)
        earlier = self._pace_reference(cell, (batch_size, size)) if cell.count >= self._window and not stale else None
        cell.samples.append(seconds / speed.factor)
        cell.passes.append((batch_size, size))
        cell.count += 1
        cell.stamp = stamp
        self._refresh(cell)
        if earlier is not None and seconds > 0.0:
            expected, scatter = earlier[0] * speed.factor, earlier[1]
            if 1.0 / self._outlier <= seconds / expected <= self._outlier:  # (a stall is not the machine's pace)
                speed.observe(seconds / expected, self, cell, scatter)

    def _pace_reference(self, cell: "_Cell", key: tuple[int, int]) -> tuple[float, float] | None:
        """What a timing of pass `key` (exact batch size and size) is evidence of the machine's
        pace against (see "Drift"): the robust mean of the cell's earlier timings of that same
        pass, before the run of evidence not yet acted on, with their scatter (the relative
        standard deviation); None with fewer than half a window of them. (Every round's
        timing comes here: ~10 us a round; logs of each timing cost as much again.)"""
        older = max(0, len(cell.samples) - self._speed.pending(cell))  # (a restarted cell: fewer)
        if cell.passes.count(key) == len(cell.passes):  # (most cells hold one exact pass)
            alike = list(islice(cell.samples, older))
        else:
            alike = [t for t, p in zip(islice(cell.samples, older), cell.passes) if p == key]
        if len(alike) < self._window // 2:
            return None
        mean, sd, _ = _robust_stats(alike, self._spread)
        return mean, sd / mean

    def _refresh(self, cell: "_Cell") -> None:
        """The cell's robust mean of its stored timings, and that mean's error."""
        self._prepared.clear()
        self._uppers.clear()
        cell.seconds, sd, n = _robust_stats(cell.samples, self._spread)
        cell.error = 2.0 * sd / math.sqrt(n) if n > 1 else cell.seconds

    @property
    def empty(self) -> bool:
        return not self._cells

    def widest(self, bucket: int | None = None) -> int:
        """The largest size measured at this batch bucket, or at any (None); 0 if none."""
        if bucket is None:
            return max(self._widest.values(), default=0)
        return self._widest.get(bucket, 0)

    def trusted(self, bucket: int, size: int) -> bool:
        """Whether the size's cell has been measured `min_samples` times (its estimate is
        then its own samples, not an optimistic bound)."""
        cell = self._cells.get((bucket, size_bucket(size)))
        return cell is not None and cell.count >= self._min_samples

    def stamp(self, bucket: int, size: int) -> int:
        """When the size's cell was last measured (-1: never)."""
        cell = self._cells.get((bucket, size_bucket(size)))
        return -1 if cell is None else cell.stamp

    def estimate(self, bucket: int, size: int) -> float | None:
        """Measured (the cell's robust mean), else the largest lower bound from measured cells, else None.

        A cell with fewer than `min_samples` samples is not trusted above the bound from the
        other cells: one slow first sample (a page fault, a kernel's first call at a new
        shape) would otherwise price drafting out for good, since a cell that looks far
        behind is never re-measured. A roofline run drafted in 0 of ~1500 rounds while its
        rerun made 1.66 tokens per step; that run kept no controller state, and this is the
        failure that fits (the test reproduces it with a 5x first sample). Without a cell
        `bounds` allows, that distrust takes any cell's bound: it only makes the estimate
        more optimistic.
        """
        return self.estimates(bucket, size)[0]

    def estimates(self, bucket: int, size: int) -> tuple[float | None, float | None]:
        """(`estimate`, upper): upper is a price this pass cannot exceed, the cheapest trusted
        cell of no fewer rows and no fewer draft tokens (cost never falls as either grows),
        or None; so a plain round is bounded by verifying ones too (they do more per token),
        a verifying round by verifying ones only (n >= size > 0)."""
        return self.priced(bucket, size)[:2]

    def priced(self, bucket: int, size: int) -> tuple[float | None, float | None, bool]:
        """(`estimate`, upper, `trusted`) of a pass (see `estimates`).

        The controller prices every plan of every round with this (its inner loop), so each
        bucket's view of the cells is made once after any cell changes (`_bucket`) and a call
        is a few binary searches. A trusted cell needs only the upper bounds (`_upper`); the
        lower bounds (`_bucket`) are made when an untrusted one is priced."""
        size = size_bucket(size)
        cell = self._cells.get((bucket, size))
        f = self._speed.factor
        upper_sizes, upper_min = self._uppers.get(bucket) or self._upper(bucket)
        i = bisect_left(upper_sizes, size)
        upper = upper_min[i] * f if i < len(upper_sizes) else None
        if cell is not None and cell.count >= self._min_samples:
            return cell.seconds * f, upper, True
        prep = self._prepared.get(bucket) or self._bucket(bucket)
        work = self._tokens(bucket, size)
        plain_only = self._plain_by_plain and size == 0
        if plain_only and prep.plain is None:  # (rarely needed: the plain cell is young)
            prep.plain = _Bounds([t for t in prep.scaled if t[2] == 0])
        best = (prep.plain if plain_only else prep.all).bound(work, cell)
        if size:  # the convexity bounds from the bucket's trusted cells of fewer drafts
            j = bisect_left(prep.below_sizes, size)
            for line in (prep.lines[j - 1] if j else None, prep.carried):
                if line is not None:
                    secant = line[0] + (work - line[1]) * line[2]
                    best = secant if best is None or secant > best else best
        if cell is None:
            estimate = None if best is None else best * f
        else:
            # a young cell is distrusted down to its bound, or, with no comparable cell, to
            # any cell's (that only makes the estimate more optimistic)
            bound = best if best is not None else prep.all.bound(work, cell)
            estimate = f * (cell.seconds if bound is None else min(cell.seconds, bound))
        # never above what trusted cells show it cannot exceed: a young cell's stall (100 ms
        # for a 4-row pass) bounds its neighbours from below at a price their trusted upper
        # bound rules out
        return (estimate if upper is None or estimate is None else min(estimate, upper)), upper, False

    def _bucket(self, bucket: int) -> "_Bucket":
        """The cells as one bucket's estimates read them, made once per change of any cell.

        A measured cell (b', n') bounds a pass (b, n) from below by
        c * min(1, b / b') * min(1, work / w'): s = c min(1, b / b') while w' <= work, s work / w'
        past it. So, the cells sorted by w', the bound at any work is the larger of a prefix
        maximum of s and work times a suffix maximum of s / w' (`_Bounds`)."""
        least, tokens = self._min_samples, self._tokens
        scaled, below, plains = [], [], []
        for (b, n), c in self._cells.items():
            scaled.append((max(tokens(b, n), 1), c.seconds * (bucket / b if bucket < b else 1.0), n, c))
            if c.count >= least:
                if b == bucket:
                    if n >= 1:
                        below.append((n, c))
                elif n == 0 and b < bucket:
                    plains.append((b, c))
        below.sort(key=itemgetter(0))  # (one cell a size)
        lines, carried = self._secants(bucket, below, plains)
        prep = self._prepared[bucket] = _Bucket(scaled, _Bounds(scaled), None, [n for n, _ in below], lines, carried)
        return prep

    def _upper(self, bucket: int) -> tuple[list, list]:
        """(sizes, least seconds from each index on) of the trusted cells of no fewer rows,
        sizes ascending (see `estimates`), made once per change of any cell."""
        least = self._min_samples
        ups = sorted([(n, c.seconds) for (b, n), c in self._cells.items() if c.count >= least and b >= bucket])
        upper_min = [0.0] * len(ups)
        low = math.inf
        for i in range(len(ups) - 1, -1, -1):
            low = upper_min[i] = min(low, ups[i][1])
        out = self._uppers[bucket] = ([n for n, _ in ups], upper_min)
        return out

    def _secants(self, bucket: int, below: list, plains: list) -> tuple[list, tuple | None]:
        """The convexity bounds of a bucket's drafting passes (speed-free), as lines
        (low, w, slope) bounding a pass of work w' past w by low + (w' - w) slope: for each
        trusted drafting cell in `below` ((n, cell), ascending) the line of the sizes past it
        (or None), and the carried one (or None) from the smaller buckets' trusted plain
        cells, `plains` ((b, cell)).

        A pass's cost is a fixed part while it is memory-bound, then grows with its tokens
        once it is compute-bound: convex in its tokens. So past the widest trusted drafting
        cell below a size (w1, c1) cost lies above the line through it and the narrowest one
        (w0, c0), of slope (c1 - c0) / (w1 - w0). The flat bound alone priced a 4-row pass of
        28 drafts at its 12-draft neighbour's 26 ms; it took 50 ms, and the probe ran three
        times (default model, code, 4 in flight; the secant through 4 and 12 drafts gives
        44 ms). Only trusted cells count (a young cell's slow first timing would make the
        slope too steep), each end moved two standard errors of its mean toward the other
        (timing noise between close sizes would otherwise read as a steep slope and price wide
        passes out: 16 rows, a fixed 60% for any drafting, 5% noise lost 0.8% of throughput).
        A cell of one timing (a stale cell restarted) is an end of no slope (its error is its
        whole mean): as the narrow end it flattened the line of a trusted 16-draft cell at 16
        rows, and 48 drafts were probed at 32 ms (they took 68; math, 16 in flight). Skipping
        such ends, or taking the steepest of all pairs, priced more exactly and lost in
        simulation (0.5% on the 60%-extra workload above; all pairs, noise selected, 0.969x
        the best fixed k against 0.974x on first 0.4 / then 0.85), so the ends stay these.

        With one trusted drafting cell below a size, the bucket's trusted plain cell is its
        narrow end at `PLAIN_SLOPE_SHARE` of the slope: a plain round does less per token than
        a verifying one (the verify round's fixed extra, rejection sampling and KV rollback,
        would read as slope), so half the slope is a bound while that extra is at most half of
        what the drafting cell costs beyond plain. Without it, 16 rows (chat) measured 16
        drafts at 1.9x a plain round, then probed 48 drafts on the flat bound from 16 (37 ms)
        and paid 77-93 ms, once or twice a run. With two drafting cells the plain end is left
        out: next to a 1-draft cell the fixed extra is all of the difference (a simulated
        fixed 60% for any drafting then priced every wider pass out).

        Carried (a table bounding plain by plain): the bucket's plain cell continued at
        `CARRIED_SLOPE_SHARE` of the slope from any smaller bucket's trusted plain cell. A row
        added to a round costs about what a draft token added to a row does (a query over a
        context, a token through the layers, one more position sampled; the row also its
        bookkeeping), and a smaller bucket's rounds have fewer tokens, so by convexity their
        slope is no steeper than the one past this bucket's plain round. Without it a bucket
        knows no slope until it has trusted drafting cells: at 16 in flight (math) the first
        16 drafts were priced at a plain round's 23 ms and paid 35-49 ms three times (a young
        cell is priced at its bound until trusted). Both ends are plain rounds, so no
        verifying extra reads as slope, and the share is all of it: measured on the Zen 4 VM
        (`bench/draft_cost.py`) a draft costs 1.23-1.36 ms at 16 rows against 1.23-1.38 ms a
        plain row between the buckets, and at half the slope chat at 16 in flight probed 16
        drafts priced 31-34 ms three times (they took 50 ms; with the whole slope its
        exploration debt was 0.7% of the rounds' seconds, not 1.5%). Where a row costs more
        than a draft (4 rows there: 0.63 ms a row between 1 and 4 rows, 0.41 ms a first
        draft) the line prices the narrowest passes a few percent high (1 draft at 4 rows:
        8.3 ms, took 8.0), so a bet on them needs that much more acceptance to be tried; on
        a memory-bound device, where a row's KV reads dominate, that could price out drafts
        that pay: a share to revisit there (issue 8).
        """
        tokens, share, least = self._tokens, self.PLAIN_SLOPE_SHARE, self._min_samples

        def line(narrow: tuple, wide: tuple, share: float) -> tuple:
            (w0, c0), (w1, c1) = narrow, wide
            low, high = c1.seconds - c1.error, c0.seconds + c0.error
            return low, w1, share * max(0.0, low - high) / (w1 - w0)

        plain = self._cells.get((bucket, 0)) if self._plain_by_plain else None
        plain_end = (tokens(bucket, 0), plain) if plain is not None and plain.count >= least else None
        lines, narrowest = [], None
        for n, c in below:
            widest = (tokens(bucket, n), c)
            if narrowest is not None:
                lines.append(line(narrowest, widest, 1.0))
            else:
                narrowest = widest
                lines.append(line(plain_end, widest, share) if plain_end is not None else None)
        carried = None
        if plain_end is not None:
            carry = self.CARRIED_SLOPE_SHARE
            slope = max([line((tokens(b, 0), c), plain_end, carry)[2] for b, c in plains], default=0.0)
            if slope > 0.0:
                carried = (plain_end[1].seconds - plain_end[1].error, plain_end[0], slope)
        return lines, carried

    def rescale(self, factor: float, cell: "_Cell | None" = None, last: int | None = None) -> None:
        """Multiply stored (speed-free) timings by `factor`: every cell's, or `cell`'s `last` ones."""
        for c in self._cells.values() if cell is None else [cell]:
            n = len(c.samples) if last is None else min(last, len(c.samples))
            keep = len(c.samples) - n
            c.samples = deque([t if i < keep else t * factor for i, t in enumerate(c.samples)], maxlen=self._window)
            self._refresh(c)

    def snapshot(self) -> list[dict]:
        """Measured cells as plain data."""
        return [{"batch_bucket": b, "size": n, "seconds": c.seconds * self._speed.factor, "samples": c.count}
                for (b, n), c in sorted(self._cells.items())]


def _robust_stats(samples, cut: float) -> tuple[float, float, int]:
    """(mean, standard deviation, count) of the timings within `cut` times their median
    (a pause is not the pass's cost); the deviation is 0 for one timing."""
    ordered = sorted(samples)
    m = len(ordered)
    median = 0.5 * (ordered[(m - 1) // 2] + ordered[m // 2])
    top = cut * median
    kept = ordered if ordered[-1] <= top else [t for t in ordered if t <= top]
    n = len(kept)
    mean = sum(kept) / n
    return mean, (math.sqrt(sum([(t - mean) ** 2 for t in kept]) / (n - 1)) if n > 1 else 0.0), n


class _Spread:
    """How alike a proposer's requests are in acceptance, from the finished ones: the weight
    a new request's prior deserves (empirical Bayes; see the module docstring, "Prior")."""

    MIN_REQUESTS = 3.0  # (decayed) finished requests before the spread is read at all

    def __init__(self, half_life_requests: float):
        self._keep = 0.5 ** (1.0 / half_life_requests)
        self._w = self._w2 = self._x = self._x2 = self._inv_n = 0.0  # decayed sums over requests

    def observe(self, successes: int, trials: int) -> None:
        """A finished request that tested `trials` positions and accepted `successes` of them."""
        if trials < 1:
            return  # it never drafted: it says nothing about acceptance
        keep, x = self._keep, successes / trials
        self._w = self._w * keep + 1.0
        self._w2 = self._w2 * keep * keep + 1.0
        self._x = self._x * keep + x
        self._x2 = self._x2 * keep + x * x
        self._inv_n = self._inv_n * keep + 1.0 / trials

    def prior_weight(self, least: float, most: float) -> float:
        """p (1 - p) / tau^2, in [least, most]: tau^2 the variance of requests' acceptance
        beyond their own binomial noise, p their mean; `least` until enough have finished."""
        w = self._w
        effective = w * w / self._w2 if w > 0.0 else 0.0  # (decayed weights: fewer than w)
        if w < self.MIN_REQUESTS or effective <= 1.0:
            return least
        mean = self._x / w
        spread = max(self._x2 / w - mean * mean, 0.0) * effective / (effective - 1.0)
        between = spread - mean * (1.0 - mean) * self._inv_n / w
        if between <= 0.0:
            return most
        return min(most, max(least, mean * (1.0 - mean) / between))


class _Ends:
    """How soon a proposer's requests end before their budget (see "Catch-ups"): decayed
    over finished requests, the early ends (EOS, a stop string) per generated token, h; a
    request that ran its budget out adds its tokens and no end (it is censored, as an
    untested draft position is). Read once `MIN_REQUESTS` (decayed) have finished."""

    MIN_REQUESTS = 3.0

    def __init__(self, half_life_requests: float):
        self._keep = 0.5 ** (1.0 / half_life_requests)
        self._requests = self._ends = self._tokens = 0.0  # decayed sums over requests

    def observe(self, tokens: int, ended_early: bool) -> None:
        keep = self._keep
        self._requests = self._requests * keep + 1.0
        self._ends = self._ends * keep + ended_early
        self._tokens = self._tokens * keep + tokens

    def expected_left(self, budget: int) -> float:
        """Tokens a request with `budget` left is expected still to make: under a constant
        chance h of ending at each token, (1 - (1 - h)^budget) / h; the budget itself
        before enough requests finished, or while none ended early."""
        if self._requests < self.MIN_REQUESTS or not self._ends or budget <= 0:
            return float(budget)
        h = min(1.0, self._ends / max(self._tokens, 1.0))
        return (1.0 - (1.0 - h) ** budget) / h


class _CatchUpPrice:
    """Seconds a token of the draft model's catch-ups cost, from the last `window` of them:
    their seconds over their tokens, leaving out any above `outlier` times the median's
    seconds a token; from fewer than `min_samples`, the cheapest among them (see "Catch-ups")."""

    def __init__(self, window: int, min_samples: int, outlier: float):
        self._samples: deque = deque(maxlen=window)  # (seconds, tokens)
        self._min_samples = min_samples
        self._outlier = outlier
        self._price: float | None = None

    def observe(self, seconds: float, tokens: int) -> None:
        self._samples.append((seconds, tokens))
        rates = sorted(s / n for s, n in self._samples)
        if len(rates) < self._min_samples:
            self._price = rates[0]
            return
        m = len(rates)
        top = self._outlier * 0.5 * (rates[(m - 1) // 2] + rates[m // 2])
        kept = [(s, n) for s, n in self._samples if s <= top * n]
        self._price = sum(s for s, _ in kept) / sum(n for _, n in kept)

    def per_token(self) -> float | None:
        """The price of a token, None before any catch-up was measured."""
        return self._price


class _Speed:
    """The machine's pace shared by the cost tables: stored timings are divided by `factor`
    when measured and estimates multiplied by its current value (see "Drift")."""

    span = 5          # recent ratios whose median is the evidence of a change of pace
    deadband = 0.10   # |log median| at or below this is noise: the factor stays
    z = 3.0           # ... and at or below this many standard errors of it (the cells' own scatter)

    def __init__(self, weight: float):
        self.weight = weight
        self.factor = 1.0
        self._recent: list = []  # (log ratio, table, cell, scatter) since the factor last moved

    def pending(self, cell: "_Cell") -> int:
        """How many of the evidence timings not yet acted on are the cell's (its latest)."""
        return sum([e[2] is cell for e in self._recent])

    def observe(self, ratio: float, table: "CostTable", cell: "_Cell", scatter: float = 0.0) -> None:
        """An established cell's timing (just stored) came in `ratio` times its earlier ones
        of the same pass, whose timings scatter by `scatter` (a relative standard deviation)."""
        if self.weight <= 0.0:
            return
        self._recent.append((math.log(ratio), table, cell, scatter))
        if len(self._recent) < self.span:
            return
        shift = sorted(r for r, _, _, _ in self._recent)[self.span // 2]
        # the median of `span` timings scattering by sd moves by ~1.25 sd / sqrt(span) on noise alone
        noise = 1.25 * sorted(e[3] for e in self._recent)[self.span // 2] / math.sqrt(self.span)
        if abs(shift) > max(self.deadband, self.z * noise):  # a sustained change of pace, not noise
            move = math.exp(self.weight * shift)
            self.factor *= move
            # the timings that showed it (not those from before it began) were stored at the
            # old pace: restate each cell's latest that many
            counts: dict[int, list] = {}
            for r, t, c, _ in self._recent:
                if abs(r - shift) < abs(r):
                    counts.setdefault(id(c), [t, c, 0])[2] += 1
            for t, c, n in counts.values():
                t.rescale(1.0 / move, c, n)
            self._recent.clear()
        else:
            self._recent.pop(0)

    def renormalise(self, tables) -> None:
        """Fold the factor back into the tables' stored timings (estimates are unchanged):
        its level is arbitrary and would otherwise wander over a long run."""
        if not 2.0 ** -20 <= self.factor <= 2.0 ** 20:
            for table in tables:
                table.rescale(self.factor)
            self.factor = 1.0


@dataclass
class _Cell:
    """One cost cell: its last timings, their robust mean, its sample count, last stamp."""

    samples: deque
    passes: deque  # each timing's exact (batch size, size)
    seconds: float = 0.0
    error: float = 0.0  # two standard errors of that mean (its whole value from one timing)
    count: int = 0
    stamp: int = -1


class _Bounds:
    """Lower bounds from a set of cells, each (w, s, n, cell): s its speed-free seconds scaled
    to the bucket's rows, w its work measure. The bound at `work` is the largest of s (cells
    with w <= work) and s * work / w (wider cells), leaving out the cell being estimated."""

    __slots__ = ("ws", "top", "second", "ratio")

    def __init__(self, cells: list[tuple]):
        cells = sorted(cells, key=lambda t: t[0])
        self.ws = [t[0] for t in cells]
        self.top, self.second = [], []  # prefix maxima of s: the best (s, cell), the best of another cell
        top = second = (-math.inf, None)
        for _, s, _, c in cells:
            if s > top[0]:
                top, second = (s, c), top
            elif s > second[0]:
                second = (s, c)
            self.top.append(top)
            self.second.append(second[0])
        self.ratio = [(0.0, 0.0, 1.0)] * (len(cells) + 1)  # suffix maxima of s / w, as (s / w, s, w)
        for i in range(len(cells) - 1, -1, -1):
            w, s = cells[i][0], cells[i][1]
            if s / w > self.ratio[i + 1][0]:
                self.ratio[i] = (s / w, s, w)
            else:
                self.ratio[i] = self.ratio[i + 1]

    def bound(self, work: float, leave_out: "_Cell | None") -> float | None:
        if not self.ws:
            return None
        i = bisect_right(self.ws, work)
        best = -math.inf
        if i:
            s, c = self.top[i - 1]
            best = s if c is not leave_out else self.second[i - 1]
        if i < len(self.ws):
            _, s, w = self.ratio[i]
            best = max(best, s * (work / w))  # (the same rounding as the bound's definition)
        return None if best == -math.inf else best


@dataclass
class _Bucket:
    """One bucket's view of a table's cells (`CostTable._bucket`)."""

    scaled: list           # every cell as (w, s, n, cell) (see `_Bounds`)
    all: _Bounds           # lower bounds from every cell
    plain: _Bounds | None  # ... from cells of size 0 (made when first needed)
    below_sizes: list      # sizes of the bucket's trusted drafting cells, ascending
    lines: list            # the convexity bound past each, (low, w, slope) or None (`CostTable._secants`)
    carried: tuple | None  # the plain cell's, on a smaller bucket's plain slope (or None)


@dataclass
class _Request:
    proposer: str
    estimator: AcceptanceEstimator  # alpha, all positions pooled (the geometric model's)
    first: AcceptanceEstimator      # position 1's acceptance (see "First draft and continuation")
    cont: AcceptanceEstimator       # positions 2.. given 1 accepted
    awaiting_test: bool = False  # chosen for a round that has not reported a tested position
    # match length -> (first, cont) of the rounds whose lookup matched that long (data only)
    by_match: dict[int, tuple[AcceptanceEstimator, AcceptanceEstimator]] = field(default_factory=dict)


@dataclass
class _Round:
    """The round chosen last, until its verify pass is reported (the exploration ledger)."""

    tokens: float             # committed so far: one per row, plus accepted drafts as reported
    explores: bool            # its plan priced a pass by an untrusted cell
    safe_rate: float          # the best plan on trusted cells only, tokens per second
    seconds: float            # its share of the catch-ups it starts, as priced; then its
                              # draft and verify passes as reported
    priced: float = math.inf  # the seconds its plan was priced at (catch-up share included)
    bucket: int = 0           # its batch bucket (each keeps a ledger of its own too)
    best: bool = False        # it plays the best plan on trusted cells, as chosen (not a probe
                              # or a stale cell's re-timing): a drafting one may be held ("Hold")

    @classmethod
    def unpriced(cls, batch_size: int) -> "_Round":
        """A round that priced no plan (a rest, a hold, nothing measured yet): entered for its
        seconds only."""
        return cls(float(batch_size), explores=False, safe_rate=0.0, seconds=0.0, bucket=batch_bucket(batch_size))


class AdaptiveController:
    """Chooses k per request each engine step; observes acceptance and measured pass times."""

    estimator_cls = AcceptanceEstimator

    def __init__(self, config: ControllerConfig | None = None):
        self.config = config if config is not None else ControllerConfig()
        cfg = self.config
        self._requests: dict[str, _Request] = {}
        self._global = {p: self.estimator_cls(a, cfg.prior_weight_tokens, cfg.prior_half_life_tokens)
                        for p, a in cfg.prior_alpha.items()}
        self._spread = {p: _Spread(cfg.spread_half_life_requests) for p in cfg.prior_alpha}
        self._ends = {p: _Ends(cfg.spread_half_life_requests) for p in cfg.prior_alpha}
        # (proposer, match length) -> (first, cont) over all requests (see "Match length")
        self._by_match: dict[tuple[str, int], tuple[AcceptanceEstimator, AcceptanceEstimator]] = {}
        self._top_match = 0  # the longest match reported so far
        # A speculative round does more per token than a plain one (drafts to verify, rejection
        # sampling, KV rollback), so only plain rounds bound a plain one (see the docstring).
        self._speed = _Speed(cfg.cost_drift)  # shared: a slowdown hits every pass alike
        self._costs = {"verify": CostTable(cfg.cost_window, lambda b, n: b + n, cfg.cost_min_samples,
                                           plain_by_plain=True,
                                           outlier=cfg.cost_outlier, speed=self._speed, spread=cfg.cost_spread),
                       "draft": CostTable(cfg.cost_window, lambda b, n: n, cfg.cost_min_samples,
                                          outlier=cfg.cost_outlier, speed=self._speed, spread=cfg.cost_spread)}
        self._catch_up = _CatchUpPrice(cfg.cost_window, cfg.cost_min_samples, cfg.cost_outlier)
        self._choice: dict[int, tuple[float, float]] = {}  # batch bucket -> decayed (seconds, rounds) of choosing
        self._num_cost_samples = 0
        self._round: _Round | None = None
        self._elapsed = 0.0        # seconds of the adaptive rounds closed so far
        self._explore_debt = 0.0   # their exploring rounds' seconds beyond the safe plan's
        self._ledgers: dict[int, list[float]] = {}  # batch bucket -> [its debt, its seconds]
        self._rounds = 0
        self._probes = 0
        self._k_counts = [0] * (cfg.k_max + 1)
        self._rest_left = 0   # rounds to rest before choosing again (see "Rest")
        self._rest_next = 1   # the next rest's length
        self._rested = 0      # rounds rested so far (for logs)
        # (see "Hold") the last choice that drafted uncapped: (rows, batch size, ks), or None
        self._last_plan: tuple[list[str], int, list[int]] | None = None
        self._hold_left = 0   # rounds that may replay it before choosing again
        self._hold_next = 1   # the next hold's length
        self._held = 0        # rounds held so far (for logs)

    expected_tokens = staticmethod(expected_tokens)

    # ---- request lifecycle -------------------------------------------------------------

    def start(self, request_id: str, proposer: str) -> None:
        """Begin tracking a request; its acceptance starts from the proposer's global estimate."""
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already started")
        if proposer not in self._global:
            raise ValueError(f"proposer must be one of {sorted(self._global)}, got {proposer!r}")
        cfg = self.config
        prior = self._global[proposer].value
        est = self.estimator_cls(prior, self.prior_weight(proposer), cfg.alpha_half_life_tokens)
        # the parts hold their data only: their prior is the request's pooled alpha (_parts)
        first, cont = (self.estimator_cls(prior, _NO_WEIGHT, cfg.alpha_half_life_tokens) for _ in range(2))
        self._requests[request_id] = _Request(proposer, est, first, cont)

    def finish(self, request_id: str, output_tokens: int | None = None, ended_early: bool = False) -> None:
        """Stop tracking a request (finished or aborted).

        output_tokens: the tokens it generated (None: not reported, as for an abort);
        ended_early: it stopped before its budget ran out (EOS or a stop string). With them
        its length feeds how soon the proposer's requests end (see "Catch-ups")."""
        if output_tokens is not None and (not isinstance(output_tokens, int) or output_tokens < 0):
            raise ValueError(f"output_tokens must be an int >= 0 or None, got {output_tokens!r}")
        req = self._request(request_id)
        del self._requests[request_id]
        est = req.estimator
        self._spread[req.proposer].observe(est.observed_successes, est.observed_tokens)
        if output_tokens is not None:
            self._ends[req.proposer].observe(output_tokens, bool(ended_early))

    def prior_weight(self, proposer: str) -> float:
        """Trials of the proposer's global estimate a request's own estimate starts from (and
        relaxes toward): `prior_weight_tokens` up to `prior_weight_max`, as alike as its
        finished requests have been (see "Prior")."""
        cfg = self.config
        return self._spread[proposer].prior_weight(cfg.prior_weight_tokens, cfg.prior_weight_max)

    def _request(self, request_id: str) -> _Request:
        req = self._requests.get(request_id)
        if req is None:
            raise ValueError(f"request_id {request_id!r} was not started (or already finished)")
        return req

    # ---- observations ------------------------------------------------------------------

    def observe_acceptance(self, request_id: str, drafted: int, accepted: int, match: int | None = None) -> None:
        """Record one verify round of a request.

        drafted: draft tokens actually proposed and verified for this row (0 tests nothing:
            no trial, no rejection; reporting it is optional).
        accepted: length of the accepted prefix of those drafts, as the rejection sampler
            decided it (before any stop-string truncation), 0 <= accepted <= drafted.
        match: the length of the suffix the n-gram lookup matched for these drafts (None:
            not a lookup; see "Match length").
        """
        if not isinstance(drafted, int) or drafted < 0:
            raise ValueError(f"drafted must be an int >= 0, got {drafted!r}")
        if not isinstance(accepted, int) or not 0 <= accepted <= drafted:
            raise ValueError(f"accepted must be an int in [0, drafted={drafted}], got {accepted!r}")
        if match is not None and (not isinstance(match, int) or match < 1):
            raise ValueError(f"match must be an int >= 1 or None, got {match!r}")
        req = self._request(request_id)
        if self._round is not None:
            self._round.tokens += accepted
        if drafted == 0:
            return  # nothing tested; choose_k relaxes the estimate if the round stays untested
        req.awaiting_test = False
        req.estimator.observe(drafted, accepted)
        self._global[req.proposer].observe(drafted, accepted)
        clock = accepted + (accepted < drafted)  # the round's tested positions
        tested_cont = accepted >= 1 and drafted >= 2  # the continuation is tested past an accepted first draft
        req.first.observe(1, min(accepted, 1), clock)
        if tested_cont:
            req.cont.observe(drafted - 1, accepted - 1, clock)
        if match is None:
            return
        self._top_match = max(self._top_match, match)
        shared = self._match_estimates(req.proposer, match)
        own = req.by_match.get(match)
        if own is None:
            own = req.by_match[match] = self._data_only_pair()
        for (first, cont), step in ((shared, None), (own, clock)):  # (the shared ones: own clock)
            first.observe(1, min(accepted, 1), step)
            if tested_cont:
                cont.observe(drafted - 1, accepted - 1, step)

    def _data_only_pair(self) -> tuple[AcceptanceEstimator, AcceptanceEstimator]:
        half_life = self.config.alpha_half_life_tokens
        return (self.estimator_cls(0.0, _NO_WEIGHT, half_life), self.estimator_cls(0.0, _NO_WEIGHT, half_life))

    def _match_estimates(self, proposer: str, match: int) -> tuple[AcceptanceEstimator, AcceptanceEstimator]:
        """The proposer's (first, cont) over every request's rounds of this match length,
        started at its global estimate worth `prior_weight_tokens` trials."""
        pair = self._by_match.get((proposer, match))
        if pair is None:
            cfg, prior = self.config, self._global[proposer].value
            pair = self._by_match[(proposer, match)] = tuple(
                self.estimator_cls(prior, cfg.prior_weight_tokens, cfg.prior_half_life_tokens) for _ in range(2))
        return pair

    def observe_cost(self, kind: str, batch_size: int, size: int, seconds: float) -> None:
        """Record the measured seconds of one steady-state pass (exclude warm-up/compile).

        kind "verify": the target's round; size = the draft tokens it verified, summed over
            rows (0 = plain decoding).
        kind "draft": the draft model's whole drafting of one round; size = the deepest row's
            k (it runs that many steps). Not reported for n-gram, whose drafting is free.
        kind "catch_up": one catch-up of the draft model's KV; size = the tokens computed.
        kind "choice": one round's n-gram lookup and choose_k (not reported by a resting
            round); size = the rows chosen for. The verify report then leaves it out.
        batch_size: rows in the pass: for "verify" the round's rows; for "draft" the rows the
            draft model drafted for (its pass's batch, often fewer than the round's).
        A round's passes are reported as the engine runs them, choice, catch-up and draft
        before verify (and acceptance during verification): the verify report closes the round.
        """
        if kind not in COST_KINDS:
            raise ValueError(f"kind must be one of {COST_KINDS}, got {kind!r}")
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
        least = 0 if kind == "verify" else 1
        if not isinstance(size, int) or size < least:
            raise ValueError(f"size must be an int >= {least} for {kind!r}, got {size!r}")
        if not (math.isfinite(seconds) and seconds >= 0.0):
            raise ValueError(f"seconds must be finite and >= 0, got {seconds!r}")
        if self._round is not None and kind != "catch_up":  # catch-ups: priced shares only
            self._round.seconds += seconds
            if kind == "verify":
                self._close_round()
        if kind == "catch_up":
            self._catch_up.observe(seconds, size)
            return
        if kind == "choice":  # a decayed mean per batch bucket, a stall counted at cost_outlier x it
            s, n = self._choice.get(batch_bucket(batch_size), (0.0, 0.0))
            if n:
                seconds = min(seconds, self.config.cost_outlier * s / n)
            keep = 1.0 - 1.0 / self.config.cost_window
            self._choice[batch_bucket(batch_size)] = (s * keep + seconds, n * keep + 1.0)
            return
        self._num_cost_samples += 1
        self._costs[kind].observe(batch_size, size, seconds, self._num_cost_samples)
        self._speed.renormalise(self._costs.values())

    def _close_round(self) -> None:
        """Enter the round just timed in the exploration ledger (see the docstring)."""
        r, self._round = self._round, None
        ledger = self._ledgers.setdefault(r.bucket, [0.0, 0.0])
        self._elapsed += r.seconds
        ledger[1] += r.seconds
        if r.explores:  # charged at most cost_outlier x its price: beyond that, a stall
            seconds = min(r.seconds, self.config.cost_outlier * r.priced)
            debt = seconds - r.tokens / max(r.safe_rate, _MIN_SECONDS)
            self._explore_debt += debt
            ledger[0] += debt

    # ---- estimates ---------------------------------------------------------------------

    def alpha(self, request_id: str) -> float:
        """Current per-position acceptance estimate of a request."""
        return self._request(request_id).estimator.value

    def estimated_cost(self, kind: str, batch_size: int, size: int) -> float | None:
        """Seconds of one pass: measured, else an optimistic bound; None if none measured."""
        return self.estimated_range(kind, batch_size, size)[0]

    def estimated_range(self, kind: str, batch_size: int, size: int) -> tuple[float | None, float | None]:
        """(`estimated_cost`, the most the pass can cost: an upper bound from trusted cells,
        None if there is none). Catch-ups and choices have no upper bound; a choice is per
        round (size is not read)."""
        if kind not in COST_KINDS:
            raise ValueError(f"kind must be one of {COST_KINDS}, got {kind!r}")
        if kind == "catch_up":
            per_token = self._catch_up.per_token()
            return (None if per_token is None else per_token * size), None
        if kind == "choice":
            s, n = self._choice.get(batch_bucket(batch_size), (0.0, 0.0))
            return (s / n if n > 0 else None), None
        return self._costs[kind].estimates(batch_bucket(batch_size), size)

    # ---- decisions ---------------------------------------------------------------------

    def choose_k(self, request_ids: list[str], batch_size: int,
                 available: list[int | None] | None = None, catch_up: list[int] | None = None,
                 remaining: list[int] | None = None, matches: list[int | None] | None = None) -> dict[str, int]:
        """k in [0, k_max] for each request of this step's batch. Call once per engine step.

        batch_size: rows in the step's verify pass (these requests and any others).
        available: per request, the drafts its proposer can deliver this round (an n-gram
            lookup's match length), or None for as many as asked (a draft model); None for
            all: every request unlimited. A request's k never exceeds it.
        catch_up: per request, the tokens a draft model must catch up on before it drafts
            (None: none for any request); remaining: per request, its output budget left
            (None: unknown, the catch-up is then charged as if to a one-token budget).
        matches: per request, the length of the suffix its n-gram lookup matched (None: not
            a lookup, or no match); a row's acceptance is then that of its match length
            (see "Match length"). Report the same with the round's acceptance.
        """
        _check_batch_size(request_ids, batch_size)
        if available is None:
            available = [None] * len(request_ids)
        elif len(available) != len(request_ids) or any(
                a is not None and (not isinstance(a, int) or a < 0) for a in available):
            raise ValueError(f"available must give an int >= 0 or None for each of the "
                             f"{len(request_ids)} requests, got {available!r}")
        n = len(request_ids)
        for name, values in (("catch_up", catch_up), ("remaining", remaining)):
            if values is not None and (len(values) != n or any(not isinstance(v, int) or v < 0 for v in values)):
                raise ValueError(f"{name} must give an int >= 0 for each of the {n} requests, got {values!r}")
        if matches is not None and (len(matches) != n or any(
                m is not None and (not isinstance(m, int) or m < 0) for m in matches)):
            raise ValueError(f"matches must give an int >= 0 or None for each of the {n} requests, got {matches!r}")
        k_max = self.config.k_max
        caps = [k_max if a is None else min(a, k_max) for a in available]
        if self._hold_left > 0 and any(caps):
            ks = self._hold(request_ids, batch_size, caps)
            if ks is not None:
                return dict(zip(request_ids, ks))
        reqs = self._begin_round(request_ids)
        if not reqs:
            return {}
        if not self.config.adaptive:
            ks = [min(self.config.fixed_k, c) for c in caps]
        else:
            ks = self._adaptive_ks(reqs, batch_size, caps, catch_up or [0] * n, remaining or [1] * n,
                                   matches or [None] * n)
            if any(caps):  # (a round with no drafts at hand leaves a hold's count as it is)
                self._note_plan(request_ids, batch_size, ks, caps)
        for k in ks:
            self._k_counts[k] += 1
        return dict(zip(request_ids, ks))

    def rest(self, request_ids: list[str], batch_size: int) -> bool:
        """Whether this round rests (see "Rest"): if so, every one of these rows plays k = 0
        without a lookup or a choice, and choose_k is not called this round."""
        _check_batch_size(request_ids, batch_size)
        if self._rest_left <= 0 or not request_ids:
            return False
        self._rest_left -= 1
        self._rested += 1
        self._begin_round(request_ids)
        self._k_counts[0] += len(request_ids)
        self._round = _Round.unpriced(batch_size)
        return True

    def _note_plan(self, request_ids: list[str], batch_size: int, ks: list[int], caps: list[int]) -> None:
        """After a choice with drafts at hand: the same drafting plan as the last such choice,
        as the best plan on trusted cells, with no row's k set by its cap, holds (see "Hold")."""
        k_max = self.config.k_max
        if not (self._round.best and any(ks) and all(k < cap or k == k_max for k, cap in zip(ks, caps))):
            self._last_plan, self._hold_next, self._hold_left = None, 1, 0
            return
        if self._last_plan == (request_ids, batch_size, ks):
            self._hold_left = min(self._hold_next, self.config.hold_max)
            self._hold_next = min(2 * self._hold_next, max(self.config.hold_max, 1))
        else:
            self._hold_next = 1
        self._last_plan = (list(request_ids), batch_size, ks)

    def _hold(self, request_ids: list[str], batch_size: int, caps: list[int]) -> list[int] | None:
        """The held plan's k for each row (at most its cap) if this round may replay it (see
        "Hold"), else None (and the hold ends)."""
        rows, size, ks = self._last_plan
        if request_ids != rows or batch_size != size or self._probe_due(ahead=1):  # (a probe's round chooses)
            self._hold_left = 0
            return None
        self._hold_left -= 1
        self._held += 1
        self._rounds += 1
        self._begin_round(request_ids)
        ks = [min(k, cap) for k, cap in zip(ks, caps)]
        for k in ks:
            self._k_counts[k] += 1
        self._round = _Round.unpriced(batch_size)
        return ks

    def _begin_round(self, request_ids: list[str]) -> list[_Request]:
        """A round's rows; those whose last round tested nothing relax (see the docstring)."""
        reqs = [self._request(r) for r in request_ids]
        self._round = None  # a round whose verify pass went unreported (a prefill step) is not entered
        keep, priors = 0.5 ** (1.0 / self.config.idle_half_life_rounds), {}
        for req in reqs:
            if req.awaiting_test:
                # the proposer's global estimate and prior weight hold for the whole round
                prior = priors.get(req.proposer)
                if prior is None:
                    prior = priors[req.proposer] = (self._global[req.proposer].value,
                                                    self.prior_weight(req.proposer))
                self._relax_untested(req, keep, prior)
            req.awaiting_test = True
        return reqs

    @staticmethod
    def _relax_untested(req: _Request, keep: float, prior: tuple[float, float]) -> None:
        """The request's last round tested nothing: its acceptance may have changed since, to
        a draw from `prior` (its proposer's global estimate and weight), with chance 1 - keep."""
        req.estimator.relax(prior[0], prior[1], keep)
        req.first.fade(keep)  # their data fades: back toward the pooled alpha
        req.cont.fade(keep)
        for first, cont in req.by_match.values():
            first.fade(keep)
            cont.fade(keep)

    def _adaptive_ks(self, reqs: list[_Request], batch_size: int, caps: list[int],
                     catch_up: list[int], remaining: list[int], matches: list[int | None]) -> list[int]:
        """Each row's k: the D largest marginal gains, for the D (and depth) with the best rate."""
        self._rounds += 1
        verify, draft = self._costs["verify"], self._costs["draft"]
        if verify.empty:
            self._round = _Round.unpriced(batch_size)
            return [0] * len(reqs)  # nothing measured: plain decoding, measured by this round
        bucket = batch_bucket(batch_size)
        if not any(caps):  # no row can draft (no n-gram match): plain, the only plan (what `plan` prices at D = 0)
            v = verify.priced(bucket, 0)[0]
            rate = _rate(float(batch_size), v or 0.0)
            self._round = _Round(float(batch_size), explores=False, safe_rate=rate, seconds=0.0,
                                 priced=math.inf if v is None else v, bucket=bucket)
            return [0] * len(reqs)
        limit = batch_size + 2 * verify.widest(bucket)  # at most double the tokens measured
        firsts, conts = self._parts(reqs, matches)
        if any(catch_up):  # (the tokens each row is expected still to make, for its catch-up's share)
            remaining = [self._ends[r.proposer].expected_left(left) for r, left in zip(reqs, remaining)]
        charge = self._catch_up_charges(caps, catch_up, remaining)
        caps = [0 if c is None else cap for cap, c in zip(caps, charge)]
        # (gain, row, position): the position-th draft of a row adds first * cont ** (position - 1)
        # tokens (see "First draft and continuation").
        gains, drafters = [], set()
        for i, (req, cap, a, c) in enumerate(zip(reqs, caps, firsts, conts)):
            g = a
            for j in range(1, cap + 1):
                gains.append((g, i, j))
                g *= c
            if cap and req.proposer not in FREE_DRAFT_PROPOSERS:
                drafters.add(i)
        gains.sort(key=itemgetter(0), reverse=True)  # stable: ties keep row order, a row's positions in order
        # The gain order ignores one-off catch-up charges, so the rows that need none are
        # also tried alone: a caught-up row may draft while the others stay plain.
        variants = [gains]
        # Rows that would start drafting (catch up on more than a round's worth of tokens):
        # their catch-ups are spent for good, so while the plan's costs are unmeasured
        # (optimistic bounds) at most one may start per round (see the docstring).
        k_max = self.config.k_max
        starters = {i for i in drafters if catch_up[i] > k_max}
        if any(charge):
            variants.append([t for t in gains if not charge[t[1]]])
            if starters:
                first = min(starters, key=lambda i: (-firsts[i], catch_up[i]))
                variants.append([t for t in gains if not charge[t[1]] or t[1] == first])
        verify_s: dict[int, tuple[float | None, float | None, bool]] = {}  # size bucket -> priced
        draft_cost: dict[tuple[int, int], tuple[float | None, float | None]] = {}
        needy = {i for i, c in enumerate(catch_up) if c}
        charged = any(charge)
        catch_up_known = self._catch_up.per_token() is not None
        choosing = self.estimated_cost("choice", batch_size, 1) or 0.0
        verify_priced, choice_price = verify.priced, self._choice_price  # (the inner loop's calls)

        def plan(pool: list, depth: int) -> list[tuple[float, int, bool, float, float | None, float, bool]]:
            """(rate, D, trusted, catch-up share, safe rate, priced seconds, starts a row) for D = 0 and the
            largest D of every size bucket within the limit; the draft pass (`depth` steps) priced at the
            rows that draft in the first D. Trusted: priced by trusted cells only (plain
            always is). Safe rate: the rate at prices it cannot exceed (its trusted cells',
            else their upper bounds from trusted cells), None if there are none. Starts a
            row: a row of `starters` drafts in it."""
            out, total, one_off, taken, rows = [], float(batch_size), 0.0, 0, set()
            for n in _sizes_upto(min(len(pool), limit)):
                if n > taken:
                    added = pool[taken:n]
                    total += sum([t[0] for t in added])
                    if charged:  # a row's share of its catch-up: the tokens the round adds (1 + alpha at a 1st draft)
                        one_off += sum(charge[t[1]] * (t[0] + (1.0 if t[2] == 1 else 0.0)) for t in added)
                    if drafters:
                        rows.update(t[1] for t in added if t[1] in drafters)
                    taken = n
                b = size_bucket(n)
                priced_v = verify_s.get(b)
                if priced_v is None:  # (estimate, upper, trusted) of the verify pass
                    priced_v = verify_s[b] = verify_priced(bucket, b)
                v, v_hi, passes_trusted = priced_v
                starts = False
                if rows:
                    key = (batch_bucket(len(rows)), depth)
                    passes_trusted = passes_trusted and draft.trusted(key[0], depth)
                    started = rows & starters
                    starts = bool(started)
                    if len(started) > 1 and not passes_trusted:
                        continue  # several catch-ups bought on optimistic prices
                    if key not in draft_cost:
                        draft_cost[key] = self.estimated_range("draft", len(rows), depth)
                    d, d_hi = draft_cost[key]
                    caught_up = catch_up_known or not rows & needy  # (no unmeasured catch-up)
                else:
                    d = d_hi = 0.0
                    caught_up = True
                extra = one_off + choice_price(choosing, n)
                # a pass with no estimate at all is unmeasured, so optimistic (free); a plan
                # with such a pass has no price to cap its round's charge (see "Exploration budget")
                priced = math.inf if v is None or d is None else v + extra + d
                rate = _rate(total, (v or 0.0) + extra + (d or 0.0))
                trusted = n == 0 or (passes_trusted and caught_up)
                safe = None
                if trusted:
                    safe = rate
                elif v_hi is not None and d_hi is not None and caught_up:
                    safe = _rate(total, v_hi + extra + d_hi)  # (estimates are never above these)
                out.append((rate, n, trusted, one_off, safe, priced, starts))
            return out

        if drafters:  # the draft model runs as many steps as the deepest row: try each depth
            # up to one step past the deepest measured: each step is a sequential forward of
            # the draft model, and an unmeasured depth's bound (flat from the measured one)
            # would otherwise send a cold controller straight to k_max
            plans = []
            deepest = min(self.config.k_max, draft.widest() + 1)
            for depth in range(1, deepest + 1):
                for variant in variants:
                    pool = [t for t in variant if t[2] <= depth or t[1] not in drafters]
                    # The gain order ignores that each drafting row adds to the draft pass,
                    # so the best m rows are also tried alone, m = 1, 2, 4, ... (a 4th gain
                    # from one row may beat a 1st from another, at less cost).
                    worth: dict[int, float] = {}
                    for g, row, _ in pool:
                        if row in drafters:
                            worth[row] = worth.get(row, 0.0) + g
                    ranked = sorted(worth, key=lambda r: -worth[r])
                    for m in _subset_sizes(len(ranked)):
                        keep = set(ranked[:m])
                        sub = [t for t in pool if t[1] not in drafters or t[1] in keep]
                        plans.append((sub, plan(sub, depth)))
        else:
            plans = [(gains, plan(gains, 0))]
        # The best plan: the highest rate, then the fewest drafts (the first of equals). The
        # safe plan: the best rate at prices it cannot exceed. D = 0 is always there; an
        # untrusted plan qualifies through upper bounds from trusted cells (see "Exploration
        # budget"), so a spent budget does not keep a batch size whose drafting passes are
        # unmeasured at plain decoding when a wider batch's measured passes show drafting pays.
        best = safe = None  # (key, pool, options, index)
        for pool, options in plans:
            for i, o in enumerate(options):
                key = (o[0], -o[1])
                if best is None or key > best[0]:
                    best = (key, pool, options, i)
                if o[4] is not None:
                    key = (o[4], -o[1])
                    if safe is None or key > safe[0]:
                        safe = (key, pool, options, i)
        may_explore = self._may_explore(bucket)
        _, pool, options, i = best if may_explore else safe
        picked = i
        plain_is_best = not options[i][1]  # (before a probe or a stale plain round moves i)
        if self._probe_due():
            probe = self._probe(options, i, bucket)
            i = probe if may_explore or options[probe][2] else i
        if options[i][1] and self._plain_is_stale(bucket, options[0][0], options[i][0]):
            i = 0  # a plain round: every drafting plan's reference, re-measured (see "Stale cells")
        self._round = _Round(float(batch_size), explores=not options[i][2], safe_rate=safe[0][0],
                             seconds=options[i][3], priced=options[i][5], bucket=bucket,
                             best=i == picked and options[i][2])
        ks = [0] * len(reqs)
        for _, row, _ in pool[: options[i][1]]:
            ks[row] += 1
        if options[i][1]:  # drafting: choose every round again
            self._rest_next = 1
        elif gains and plain_is_best and self._match_was_strongest(matches, caps):
            # plain the best with drafts at hand, the best-matched ones too: rest, longer each time
            self._rest_left = min(self._rest_next, self.config.rest_max)
            self._rest_next = min(2 * self._rest_next, max(self.config.rest_max, 1))
        return ks

    def _may_explore(self, bucket: int) -> bool:
        """Whether an untrusted plan may be played (see "Exploration budget"): the run's debt
        within its budget, and the bucket's within the bucket's own."""
        budget = self.config.explore_budget
        if budget == math.inf:
            return True
        debt, seconds = self._ledgers.get(bucket, (0.0, 0.0))
        return self._explore_debt <= budget * self._elapsed and debt <= budget * seconds

    @staticmethod
    def _choice_price(choosing: float, drafts: int) -> float:
        """What choosing adds to a plan of `drafts` draft tokens: a drafting plan chooses again
        next round (or holds: the choice's mean has its cheaper rounds, see "Hold"), plain with
        drafts at hand rests (see "Rest")."""
        return choosing if drafts else 0.0

    def _catch_up_charges(self, caps: list[int], catch_up: list[int], remaining: list[int]) -> list[float | None]:
        """Per row, the seconds of its catch-up per token of its remaining budget (charged
        per expected token of each round it drafts; 0 for a row that needs none), or None
        for a row that may not draft this round: while no catch-up has been measured,
        every row needing one but the one missing the fewest tokens (whose pass,
        optimistically free, measures the price)."""
        if not any(catch_up):  # (an n-gram batch: none to charge)
            return [0.0] * len(catch_up)
        per_token = self._catch_up.per_token()
        if per_token is None:
            needy = [i for i, (cap, c) in enumerate(zip(caps, catch_up)) if cap and c]
            first = min(needy, key=lambda i: catch_up[i], default=None)
            return [None if c and i != first else 0.0 for i, c in enumerate(catch_up)]
        return [c * per_token / max(rem, 1) if c else 0.0 for c, rem in zip(catch_up, remaining)]

    def _match_was_strongest(self, matches: list[int | None], caps: list[int]) -> bool:
        """Whether this round's rows with drafts included a match as long as any seen (a
        plain choice then says drafting does not pay even at its best; after a plain choice
        on short matches only, the next round may bring a long one, so no rest)."""
        known = [m for m, cap in zip(matches, caps) if m is not None and cap]
        return not known or max(known) >= self._top_match

    def _parts(self, reqs: list[_Request], matches: list[int | None]) -> tuple[list[float], list[float]]:
        """Each row's first-draft and continuation acceptance (see "First draft and
        continuation"): a part's data with the row's pooled alpha worth
        `prior_weight(proposer)` trials as its prior, relative to that pooled alpha, times
        the row's pooled alpha as shrunk across the batch (`_pooled_alphas`). A part with no
        data of its own is the pooled alpha: the geometric model. A row with a match length
        (see "Match length"): its rounds of that length with the proposer's estimate for the
        length as the prior, worth `prior_weight(proposer)` trials."""
        firsts, conts = [], []
        shared_by_row = [self._by_match.get((r.proposer, m)) if m else None for r, m in zip(reqs, matches)]
        # (the batch's shrunk alphas only where a row has no match length: an n-gram batch
        # at 1 in flight rarely needs them, and every microsecond here is on the hot path)
        pooled = self._pooled_alphas(reqs) if None in shared_by_row else [None] * len(reqs)
        weights = {p: self.prior_weight(p) for p in {r.proposer for r in reqs}}  # ("Prior"), once a proposer
        for r, shrunk, match, shared in zip(reqs, pooled, matches, shared_by_row):
            if shared is not None:
                own = r.by_match.get(match)
                wm = weights[r.proposer]
                for i, out in ((0, firsts), (1, conts)):
                    part, prior = (own[i] if own else None), shared[i].value
                    out.append(prior if part is None else (part.successes + wm * prior) / (part.trials + wm))
                continue
            raw, w = r.estimator.value, weights[r.proposer]
            for part, out in ((r.first, firsts), (r.cont, conts)):
                own = (part.successes + w * raw) / (part.trials + w)
                out.append(min(1.0, shrunk * own / raw) if raw > 0 else own)
        return firsts, conts

    def _pooled_alphas(self, reqs: list[_Request]) -> list[float]:
        """Each row's acceptance, shrunk toward its batch's (rows of the same proposer) by
        as much as its own noise explains of the spread between rows (empirical Bayes).

        A row's own estimate rests on ~30 tested positions (sd ~0.08 at alpha 0.7), and the
        allocation hands more drafts to whichever row looks best: on a batch of alike rows,
        that noise alone spread the drafts unevenly and lost 2-3% against an even fixed k
        (simulation, 8 rows at alpha 0.7). With w_r = noise_r / (noise_r + spread), where
        noise_r = a (1 - a) / trials_r at the batch's estimate a and spread is the variance
        between rows beyond that noise, alike rows move to the batch's estimate and real
        differences (a row quoting its prompt at 0.95 next to chat at 0.3) stay.
        """
        groups: dict[str, list[int]] = {}
        for i, r in enumerate(reqs):
            groups.setdefault(r.proposer, []).append(i)
        out = [0.0] * len(reqs)
        for rows in groups.values():
            ests = [reqs[i].estimator for i in rows]
            pooled = sum(e.successes for e in ests) / sum(e.trials for e in ests)
            noise = [pooled * (1.0 - pooled) / e.trials for e in ests]
            spread = max(0.0, sum((e.value - pooled) ** 2 for e in ests) / len(ests)
                         - sum(noise) / len(noise))
            for i, e, v in zip(rows, ests, noise):
                w = v / (v + spread) if v + spread > 0 else 0.0
                out[i] = min(max(w * pooled + (1.0 - w) * e.value, 0.0), 1.0)
        return out

    def _probe(self, options: list[tuple], i: int, bucket: int) -> int:
        """The neighbour of option i whose size was measured longest ago, if it could win
        and starts no row drafting (see "Stale cells").

        Only a neighbour within `explore_within` of the best estimated rate is worth a round
        at its price: at batch 16 a pass with one draft per row costs 2x a plain one, and
        probing it when it is far behind was a steady few percent lost (bench/adaptive.py).
        """
        nbrs = [j for j in (i - 1, i + 1) if 0 <= j < len(options)]
        if not nbrs:
            return i
        table = self._costs["verify"]
        j = min(nbrs, key=lambda j: table.stamp(bucket, options[j][1]))
        if options[j][0] >= (1.0 - self.config.explore_within) * options[i][0] and not options[j][6]:
            self._probes += 1
            return j
        return i

    def _plain_is_stale(self, bucket: int, plain_rate: float, best_rate: float) -> bool:
        """Whether plain decoding at this bucket was last timed more than two windows of
        passes ago (or never) while its rate is within `explore_within` of the chosen plan's."""
        age = self._num_cost_samples - self._costs["verify"].stamp(bucket, 0)
        return age > 2 * self.config.cost_window and plain_rate >= (1.0 - self.config.explore_within) * best_rate

    def _probe_due(self, ahead: int = 0) -> bool:
        """Deterministic: true on a fraction `explore` of rounds, evenly spread (this round's,
        or the one `ahead` rounds on)."""
        e, rounds = self.config.explore, self._rounds + ahead
        return math.floor(rounds * e) > math.floor((rounds - 1) * e)

    # ---- logs --------------------------------------------------------------------------

    def snapshot(self) -> dict:
        """Plain-data state for logs and metrics."""
        return {
            "config": self.config.to_dict(),
            "rounds": self._rounds,
            "rested_rounds": self._rested,
            "held_rounds": self._held,
            "probes": self._probes,
            "explore_debt_s": self._explore_debt,
            "elapsed_s": self._elapsed,
            "k_counts": list(self._k_counts),
            "global_alpha": {p: e.value for p, e in self._global.items()},
            "prior_weight": {p: self.prior_weight(p) for p in self._global},
            "alpha_by_match": {f"{p}/{m}": {"first": first.value, "cont": cont.value}
                               for (p, m), (first, cont) in sorted(self._by_match.items())},
            "requests": {rid: {"proposer": r.proposer, "alpha": r.estimator.value, "alpha_first": r.first.value,
                               "alpha_cont": r.cont.value,
                               "observed_tokens": r.estimator.observed_tokens}
                         for rid, r in self._requests.items()},
            "costs": {kind: t.snapshot() for kind, t in self._costs.items()},
            "choice_s": {str(b): s / n for b, (s, n) in sorted(self._choice.items())},
            "catch_up_s_per_token": self._catch_up.per_token(),
            "expected_left_of_64": {p: e.expected_left(64) for p, e in self._ends.items()},
            "speed_factor": self._speed.factor,
        }


def _check_batch_size(request_ids: list[str], batch_size: int) -> None:
    if not isinstance(batch_size, int) or batch_size < max(1, len(request_ids)):
        raise ValueError(f"batch_size must be an int >= max(1, len(request_ids)={len(request_ids)}), "
                         f"got {batch_size!r}")


def _rate(tokens: float, seconds: float) -> float:
    return tokens / max(seconds, _MIN_SECONDS)


def _subset_sizes(n: int) -> list[int]:
    """1, 2, 4, ... below n, then n itself (subset sizes worth a plan of their own)."""
    out, m = [], 1
    while m < n:
        out.append(m)
        m *= 2
    return out + [n] if n else out


@lru_cache(maxsize=1024)
def _sizes_upto(n: int) -> tuple[int, ...]:
    """0 and the largest member of every size bucket up to n, then n itself (memoised: every
    plan of every round asks)."""
    out = [0]
    m = 1
    while m <= n:
        b = size_bucket(m)
        out.append(min(b, n))
        m = b + 1
    return tuple(out)
