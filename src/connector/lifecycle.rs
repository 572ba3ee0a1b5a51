//! The request state machine: where one request stands between admission and its last byte moved.
//!
//! A [`Lifecycle`] owns exactly one thing, the [`RequestState`] of one [`RequestId`], and changes
//! it only through one method per engine/connector event. Each method either moves to the state
//! the event implies or, if that event is not allowed in the current state, returns
//! [`ErrorKind::InvalidState`] and leaves the state unchanged. The error's message and context
//! name the request (`request`), the state it was in (`state`), the event (`event`) and the
//! state the event would have led to (`target`).
//!
//! ```text
//!            stage_onboard            start_onboard
//!   New ─────────────────▶ OnboardStaged ──────────▶ Onboarding
//!    │ ◀───── unstage ───────┘  │                        │
//!    │                          │ schedule               │ schedule
//!    └──────── schedule ────────┴──────────┬─────────────┘
//!                                          ▼
//!            preempt ┌──────────── Prefilling ─ schedule(prompt_done) ─▶ Decoding
//!   Preempted ◀──────┴───────────────────────────────────────────────────────┘
//!    │  schedule ─▶ Prefilling/Decoding;  stage_onboard ─▶ OnboardStaged
//!
//!   finish (from any non-finishing state):
//!     loads in flight ─▶ Aborted;  else stores in flight ─▶ Finishing;  else ─▶ Finished
//!   drained: Finishing | Aborted ─▶ Finished
//! ```
//!
//! Invariants:
//!
//! * `Finished` is terminal: only `drained` (a no-op) is accepted there.
//! * Once finishing (`Finishing`, `Aborted`, `Finished`), no event but `drained` is accepted; a
//!   second `finish` is an error ("already finished").
//! * A request is `Onboarding` only after `OnboardStaged`, and `Preempted` only after it ran
//!   (`Prefilling` or `Decoding`).
//! * No input makes any method panic.

use serde::{Deserialize, Serialize};

use super::RequestId;
use crate::error::{Error, ErrorKind, Result};

/// Where a request stands. Serialised and displayed in `snake_case` (`onboard_staged`).
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    Hash,
    Serialize,
    Deserialize,
    strum::Display,
    strum::IntoStaticStr,
)]
#[serde(rename_all = "snake_case")]
#[strum(serialize_all = "snake_case")]
pub enum RequestState {
    /// Slot created; nothing matched or scheduled yet.
    New,
    /// Host/disk blocks matched and held; waiting for the engine to allocate device blocks.
    OnboardStaged,
    /// Load operations scheduled or in flight into device blocks.
    Onboarding,
    /// Prompt being computed (possibly chunked over several iterations).
    Prefilling,
    /// Prompt fully computed; generating.
    Decoding,
    /// The engine freed the device blocks; the request may come back.
    Preempted,
    /// Finished normally while stores are still in flight.
    Finishing,
    /// Finished while loads (and maybe stores) were in flight; waiting for them to drain.
    Aborted,
    /// Terminal; nothing in flight.
    Finished,
}

impl RequestState {
    /// `Finishing`, `Aborted` or `Finished`: the engine is done with the request.
    fn is_finishing(self) -> bool {
        matches!(
            self,
            RequestState::Finishing | RequestState::Aborted | RequestState::Finished
        )
    }
}

/// One event applied to a [`Lifecycle`]; the transition table is [`Event::next`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Event {
    StageOnboard,
    Unstage,
    StartOnboard,
    Schedule { prompt_done: bool },
    Preempt,
    Finish { loads: bool, stores: bool },
    Drained,
}

impl Event {
    /// The event's name in errors (the method that applies it).
    fn name(self) -> &'static str {
        match self {
            Event::StageOnboard => "stage_onboard",
            Event::Unstage => "unstage",
            Event::StartOnboard => "start_onboard",
            Event::Schedule { .. } => "schedule",
            Event::Preempt => "preempt",
            Event::Finish { .. } => "finish",
            Event::Drained => "drained",
        }
    }

    /// The state this event leads to when it is allowed (named in errors when it is not).
    fn target(self) -> RequestState {
        use RequestState as S;
        match self {
            Event::StageOnboard => S::OnboardStaged,
            Event::Unstage => S::New,
            Event::StartOnboard => S::Onboarding,
            Event::Schedule { prompt_done: false } => S::Prefilling,
            Event::Schedule { prompt_done: true } => S::Decoding,
            Event::Preempt => S::Preempted,
            Event::Finish { loads: true, .. } => S::Aborted,
            Event::Finish {
                loads: false,
                stores: true,
            } => S::Finishing,
            Event::Finish {
                loads: false,
                stores: false,
            } => S::Finished,
            Event::Drained => S::Finished,
        }
    }

    /// The transition table: the next state, or why the event is not allowed in `from`.
    fn next(self, from: RequestState) -> std::result::Result<RequestState, &'static str> {
        use RequestState as S;
        match (self, from) {
            // From Onboarding only once its loads finished (the leader checks): the engine matches
            // again after a load failed on the first blocks.
            (Event::StageOnboard, S::New | S::OnboardStaged | S::Preempted | S::Onboarding) => {
                Ok(S::OnboardStaged)
            }

            (Event::Unstage, S::OnboardStaged | S::New | S::Onboarding) => Ok(S::New),
            (Event::Unstage, S::Preempted) => Ok(S::Preempted),

            (Event::StartOnboard, S::OnboardStaged) => Ok(S::Onboarding),

            (Event::Schedule { prompt_done: false }, S::Decoding) => {
                Err("the prompt is already computed")
            }
            (
                Event::Schedule { .. },
                S::New
                | S::OnboardStaged
                | S::Onboarding
                | S::Prefilling
                | S::Decoding
                | S::Preempted,
            ) => Ok(self.target()),

            (Event::Preempt, S::Prefilling | S::Decoding | S::Preempted) => Ok(S::Preempted),
            // Only once its loads finished (the leader checks): it was running, or admitted.
            (Event::Preempt, S::Onboarding) => Ok(S::Preempted),
            (Event::Preempt, S::New | S::OnboardStaged) => Err("the request never ran"),

            (Event::Finish { .. }, s) if s.is_finishing() => Err("already finished"),
            (Event::Finish { .. }, _) => Ok(self.target()),

            (Event::Drained, S::Finishing | S::Aborted | S::Finished) => Ok(S::Finished),
            (Event::Drained, _) => Err("the request has not finished"),

            (_, s) if s.is_finishing() => Err("the request has finished"),
            _ => Err("not allowed in this state"),
        }
    }
}

/// The state of one request, changed only through its event methods.
#[derive(Debug, Clone)]
pub struct Lifecycle {
    id: RequestId,
    state: RequestState,
}

impl Lifecycle {
    /// A new request in state [`RequestState::New`].
    pub fn new(id: RequestId) -> Self {
        Self {
            id,
            state: RequestState::New,
        }
    }

    /// A lifecycle already in `state` (tests only: reaches every state directly).
    #[cfg(test)]
    fn with_state(id: RequestId, state: RequestState) -> Self {
        Self { id, state }
    }

    /// The request's id.
    pub fn id(&self) -> &RequestId {
        &self.id
    }

    /// The current state.
    pub fn state(&self) -> RequestState {
        self.state
    }

    /// `true` in [`RequestState::Finished`]: nothing is in flight and no event changes the state.
    pub fn is_terminal(&self) -> bool {
        self.state == RequestState::Finished
    }

    /// `true` once the engine finished the request: `Finishing`, `Aborted` or `Finished`.
    pub fn is_finishing(&self) -> bool {
        self.state.is_finishing()
    }

    /// Matched blocks were staged. From `New`, `OnboardStaged` (a re-match replaces the staging)
    /// or `Preempted` (re-admitted after preemption) to `OnboardStaged`.
    pub fn stage_onboard(&mut self) -> Result<()> {
        self.apply(Event::StageOnboard)
    }

    /// The staging was dropped (a re-match found nothing, or the engine allocated with 0 external
    /// tokens). `OnboardStaged` → `New`; in `New` or `Preempted`, a no-op.
    pub fn unstage(&mut self) -> Result<()> {
        self.apply(Event::Unstage)
    }

    /// Load operations were scheduled. `OnboardStaged` → `Onboarding`.
    pub fn start_onboard(&mut self) -> Result<()> {
        self.apply(Event::StartOnboard)
    }

    /// The engine scheduled the request for computation this iteration; `prompt_done` says every
    /// prompt token is computed after this iteration. From `New`, `OnboardStaged` (the engine
    /// chose not to load), `Onboarding` (loads finished), `Prefilling` or `Preempted` (resumed) to
    /// `Decoding` if `prompt_done`, else `Prefilling`. In `Decoding` it stays `Decoding`, and
    /// `prompt_done == false` is an error.
    pub fn schedule(&mut self, prompt_done: bool) -> Result<()> {
        self.apply(Event::Schedule { prompt_done })
    }

    /// The engine preempted the request (freed its device blocks). From `Prefilling` or
    /// `Decoding` to `Preempted`; in `Preempted`, a no-op. Anywhere else (including `Onboarding`:
    /// a loading request is not running) an error.
    pub fn preempt(&mut self) -> Result<()> {
        self.apply(Event::Preempt)
    }

    /// The engine finished (or aborted) the request; `loads_in_flight` and `stores_in_flight` say
    /// what is still running. From any non-finishing state to `Aborted` if loads are in flight,
    /// else `Finishing` if stores are, else `Finished`. A second finish is an error
    /// ("already finished").
    pub fn finish(&mut self, loads_in_flight: bool, stores_in_flight: bool) -> Result<()> {
        self.apply(Event::Finish {
            loads: loads_in_flight,
            stores: stores_in_flight,
        })
    }

    /// Everything in flight has drained. `Finishing` or `Aborted` → `Finished`; in `Finished`, a
    /// no-op; before the request finished, an error.
    pub fn drained(&mut self) -> Result<()> {
        self.apply(Event::Drained)
    }

    /// Applies `event`: moves to its next state, or leaves the state as is and reports why not.
    fn apply(&mut self, event: Event) -> Result<()> {
        match event.next(self.state) {
            Ok(next) => {
                if next != self.state {
                    tracing::trace!(
                        request = %self.id,
                        from = %self.state,
                        to = %next,
                        event = event.name(),
                        "request state"
                    );
                }
                self.state = next;
                Ok(())
            }
            Err(why) => Err(self.invalid(event, why)),
        }
    }

    /// The [`ErrorKind::InvalidState`] error for `event` refused in the current state.
    fn invalid(&self, event: Event, why: &str) -> Error {
        let (id, from, name, target) = (&self.id, self.state, event.name(), event.target());
        Error::new(
            ErrorKind::InvalidState,
            format!("request {id}: cannot {name} (to {target}) in state {from}: {why}"),
        )
        .with("request", id)
        .with("state", from)
        .with("event", name)
        .with("target", target)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use RequestState as S;

    const STATES: [RequestState; 9] = [
        S::New,
        S::OnboardStaged,
        S::Onboarding,
        S::Prefilling,
        S::Decoding,
        S::Preempted,
        S::Finishing,
        S::Aborted,
        S::Finished,
    ];

    const EVENTS: [Event; 11] = [
        Event::StageOnboard,
        Event::Unstage,
        Event::StartOnboard,
        Event::Schedule { prompt_done: false },
        Event::Schedule { prompt_done: true },
        Event::Preempt,
        Event::Finish {
            loads: false,
            stores: false,
        },
        Event::Finish {
            loads: false,
            stores: true,
        },
        Event::Finish {
            loads: true,
            stores: false,
        },
        Event::Finish {
            loads: true,
            stores: true,
        },
        Event::Drained,
    ];

    /// Calls the public method for `event` (so the table tests the API, not just `Event::next`).
    fn call(lc: &mut Lifecycle, event: Event) -> Result<()> {
        match event {
            Event::StageOnboard => lc.stage_onboard(),
            Event::Unstage => lc.unstage(),
            Event::StartOnboard => lc.start_onboard(),
            Event::Schedule { prompt_done } => lc.schedule(prompt_done),
            Event::Preempt => lc.preempt(),
            Event::Finish { loads, stores } => lc.finish(loads, stores),
            Event::Drained => lc.drained(),
        }
    }

    /// The expected table, written out row by row: `None` is an `InvalidState` error.
    fn expected(from: RequestState) -> [Option<RequestState>; 11] {
        let x = None;
        //  stage_onboard      unstage          start_onboard     sched(false)       sched(true)
        //  preempt            fin(-,-)         fin(-,S)          fin(L,-)           fin(L,S)
        //  drained
        match from {
            S::New => [
                Some(S::OnboardStaged),
                Some(S::New),
                x,
                Some(S::Prefilling),
                Some(S::Decoding),
                x,
                Some(S::Finished),
                Some(S::Finishing),
                Some(S::Aborted),
                Some(S::Aborted),
                x,
            ],
            S::OnboardStaged => [
                Some(S::OnboardStaged),
                Some(S::New),
                Some(S::Onboarding),
                Some(S::Prefilling),
                Some(S::Decoding),
                x,
                Some(S::Finished),
                Some(S::Finishing),
                Some(S::Aborted),
                Some(S::Aborted),
                x,
            ],
            S::Onboarding => [
                Some(S::OnboardStaged),
                Some(S::New),
                x,
                Some(S::Prefilling),
                Some(S::Decoding),
                Some(S::Preempted),
                Some(S::Finished),
                Some(S::Finishing),
                Some(S::Aborted),
                Some(S::Aborted),
                x,
            ],
            S::Prefilling => [
                x,
                x,
                x,
                Some(S::Prefilling),
                Some(S::Decoding),
                Some(S::Preempted),
                Some(S::Finished),
                Some(S::Finishing),
                Some(S::Aborted),
                Some(S::Aborted),
                x,
            ],
            S::Decoding => [
                x,
                x,
                x,
                x,
                Some(S::Decoding),
                Some(S::Preempted),
                Some(S::Finished),
                Some(S::Finishing),
                Some(S::Aborted),
                Some(S::Aborted),
                x,
            ],
            S::Preempted => [
                Some(S::OnboardStaged),
                Some(S::Preempted),
                x,
                Some(S::Prefilling),
                Some(S::Decoding),
                Some(S::Preempted),
                Some(S::Finished),
                Some(S::Finishing),
                Some(S::Aborted),
                Some(S::Aborted),
                x,
            ],
            S::Finishing | S::Aborted => [x, x, x, x, x, x, x, x, x, x, Some(S::Finished)],
            S::Finished => [x, x, x, x, x, x, x, x, x, x, Some(S::Finished)],
        }
    }

    #[test]
    fn every_state_event_pair_matches_the_table() {
        let mut checked = 0;
        for from in STATES {
            for (event, want) in EVENTS.into_iter().zip(expected(from)) {
                let mut lc = Lifecycle::with_state(RequestId::from("req-7"), from);
                let got = call(&mut lc, event);
                match (want, got) {
                    (Some(to), Ok(())) => {
                        assert_eq!(lc.state(), to, "{from} + {event:?}");
                    }
                    (None, Err(e)) => {
                        assert_eq!(e.kind(), ErrorKind::InvalidState, "{from} + {event:?}");
                        assert_eq!(lc.state(), from, "state changed after error: {event:?}");
                        assert_eq!(e.context_value("request"), Some("req-7"));
                        assert_eq!(e.context_value("state"), Some(from.into()));
                        assert_eq!(e.context_value("event"), Some(event.name()));
                        let target: &str = event.target().into();
                        assert_eq!(e.context_value("target"), Some(target));
                        let msg = e.message();
                        assert!(msg.contains("req-7"), "{msg}");
                        assert!(msg.contains(&from.to_string()), "{msg}");
                        assert!(msg.contains(event.name()), "{msg}");
                    }
                    (want, got) => panic!("{from} + {event:?}: want {want:?}, got {got:?}"),
                }
                checked += 1;
            }
        }
        assert_eq!(checked, 9 * 11);
    }

    #[test]
    fn predicates() {
        for s in STATES {
            let lc = Lifecycle::with_state(RequestId::from(1u64), s);
            assert_eq!(lc.is_terminal(), s == S::Finished, "{s}");
            assert_eq!(
                lc.is_finishing(),
                matches!(s, S::Finishing | S::Aborted | S::Finished),
                "{s}"
            );
        }
    }

    #[test]
    fn cold_request() -> Result<()> {
        let mut lc = Lifecycle::new(RequestId::from("cold"));
        assert_eq!(lc.state(), S::New);
        assert_eq!(lc.id().as_str(), "cold");
        lc.schedule(false)?;
        assert_eq!(lc.state(), S::Prefilling);
        lc.schedule(false)?; // next chunk
        assert_eq!(lc.state(), S::Prefilling);
        lc.schedule(true)?;
        assert_eq!(lc.state(), S::Decoding);
        lc.schedule(true)?;
        assert_eq!(lc.state(), S::Decoding);
        lc.finish(false, true)?;
        assert_eq!(lc.state(), S::Finishing);
        assert!(lc.is_finishing() && !lc.is_terminal());
        lc.drained()?;
        assert_eq!(lc.state(), S::Finished);
        assert!(lc.is_terminal());
        Ok(())
    }

    #[test]
    fn onboard() -> Result<()> {
        let mut lc = Lifecycle::new(RequestId::from("warm"));
        lc.stage_onboard()?;
        assert_eq!(lc.state(), S::OnboardStaged);
        lc.stage_onboard()?; // re-match replaces the staging
        lc.start_onboard()?;
        assert_eq!(lc.state(), S::Onboarding);
        lc.schedule(false)?;
        assert_eq!(lc.state(), S::Prefilling);
        Ok(())
    }

    #[test]
    fn unstage_returns_to_new() -> Result<()> {
        let mut lc = Lifecycle::new(RequestId::from("u"));
        lc.stage_onboard()?;
        lc.unstage()?;
        assert_eq!(lc.state(), S::New);
        lc.unstage()?;
        assert_eq!(lc.state(), S::New);
        Ok(())
    }

    #[test]
    fn preempt_and_resume() -> Result<()> {
        let mut lc = Lifecycle::new(RequestId::from("p"));
        lc.schedule(true)?;
        lc.preempt()?;
        assert_eq!(lc.state(), S::Preempted);
        lc.preempt()?; // repeated preemption notice is a no-op
        lc.unstage()?; // nothing staged: no-op
        assert_eq!(lc.state(), S::Preempted);
        // Resumed straight into computation.
        lc.schedule(false)?;
        assert_eq!(lc.state(), S::Prefilling);
        // Preempted again, then re-admitted with a host match.
        lc.preempt()?;
        lc.stage_onboard()?;
        lc.start_onboard()?;
        lc.schedule(true)?;
        assert_eq!(lc.state(), S::Decoding);
        lc.finish(false, false)?;
        assert!(lc.is_terminal());
        Ok(())
    }

    #[test]
    fn preempt_after_onboarding_is_allowed() {
        // The leader refuses it while loads are still in flight; the state machine allows it
        // once they finished (an engine may admit and preempt a loaded request in one step).
        let mut lc = Lifecycle::with_state(RequestId::from("o"), S::Onboarding);
        assert!(lc.preempt().is_ok());
        assert_eq!(lc.state(), S::Preempted);
    }

    #[test]
    fn abort_while_loading() -> Result<()> {
        let mut lc = Lifecycle::new(RequestId::from("a"));
        lc.stage_onboard()?;
        lc.start_onboard()?;
        lc.finish(true, true)?;
        assert_eq!(lc.state(), S::Aborted);
        assert!(lc.is_finishing() && !lc.is_terminal());
        lc.drained()?;
        assert_eq!(lc.state(), S::Finished);
        lc.drained()?; // idempotent
        assert_eq!(lc.state(), S::Finished);
        Ok(())
    }

    #[test]
    fn duplicate_finish_names_the_request() -> Result<()> {
        let mut lc = Lifecycle::new(RequestId::from(42u64));
        lc.schedule(true)?;
        lc.finish(false, false)?;
        let Err(err) = lc.finish(false, false) else {
            panic!("duplicate finish accepted");
        };
        assert_eq!(err.kind(), ErrorKind::InvalidState);
        assert_eq!(err.context_value("request"), Some("42"));
        assert_eq!(err.context_value("state"), Some("finished"));
        assert_eq!(err.context_value("event"), Some("finish"));
        assert!(err.message().contains("already finished"), "{err}");
        assert_eq!(
            err.to_string(),
            "invalid_state: request 42: cannot finish (to finished) in state finished: \
             already finished (request=42, state=finished, event=finish, target=finished)"
        );
        assert_eq!(lc.state(), S::Finished);
        Ok(())
    }

    #[test]
    fn decoding_rejects_unfinished_prompt() {
        let mut lc = Lifecycle::with_state(RequestId::from("d"), S::Decoding);
        let err = lc.schedule(false).err();
        assert_eq!(err.map(|e| e.kind()), Some(ErrorKind::InvalidState));
        assert_eq!(lc.state(), S::Decoding);
    }

    #[test]
    fn state_names() {
        assert_eq!(S::OnboardStaged.to_string(), "onboard_staged");
        let s: &str = S::Preempted.into();
        assert_eq!(s, "preempted");
    }
}
