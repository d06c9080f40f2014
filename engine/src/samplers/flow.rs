//! Flow-matching samplers: diffusers' `UniPCMultistepScheduler` (flow prediction, flow
//! shift) and `FlowMatchEulerDiscreteScheduler`, each from its saved config.
