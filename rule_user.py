"""The offline rule user: a deterministic simulated user with no LLM, English only (`--backend rule`).

It asks what a person would: is this a coherent reply, in sentences, to what I said, that meets my
hidden need, without repeating itself? Every change comes with its reason. What each finding costs or
earns, and every threshold, is named in POINTS and THRESHOLDS below: a reward-shaping ablation edits
those two tables and nothing else. The rules, applied to each reply:

1. Defects void any gain and cost emotion: garbled or non-language text; text addressed to a scorer,
   a simulator or its instructions; dismissive phrases; stock empathy phrases used twice, or three
   times or more; a reply that repeats its own sentences or an earlier reply, also as a template with
   other words slotted in; copying the user's sentences back, or only the user's words back, listed,
   shuffled or reversed (an echo: fewer than 2 content words of its own); filler words; cue phrases
   stuffed together or a sentence of comma-separated fragments; only questions; padding; leaked
   `<think>` tags; a curt reply.
2. Grounding: a reply that takes up fewer than `grounding_words` content words of the user's story
   costs "generic" however kind ("could be said to anyone"). The story is what the user said (the
   opening and the own-words lines told since, never the rule user's canned reactions); a word of the
   profile's untold story (a paraphrase that names part of it) can stand in for one of them, not for
   all. The vanilla user forgives a reply that is partly about it once, after a turn that went well.
3. A grounded reply gains by how well it serves the hidden intention: each intention has a few cue
   families (e.g. "wants to be heard": names my feeling, reflects what I said, validates, invites me
   to go on; "wants advice": concrete options, first steps), each a set of phrases (never single
   words), counted once however often they repeat. The families needed for "gain" and "gain_big"
   depend on the variant (vanilla: 1 and 2; challenging: 2 and 3).
4. Frictions add to the gain: lecturing (two phrases, or one when the person wants to vent, be
   empathised with, praised or cleared), blaming someone who wants to hear they were not at fault,
   solutions pushed on someone who wants to be heard, cues against the need (clearing someone who
   wants to see their own part, both sides or the other's motives; the other side's reasons for
   someone who wants to hear they were not at fault), and patience: a second reply in a row that
   does not help ("stalling").

The user's next message is written from the profile: a reaction to the reply, then the next of the
profile's own-words lines (`## In <name>'s own words` in the scene) when the reply did not hurt, so
later replies can ground in more of the story. Variants: vanilla says what helped or hurt and nudges
toward what it wants; challenging needs more for a gain and answers tersely without saying why.
Chinese profiles are refused: the rule user has no Chinese cues and never scores Chinese text with
English ones. docs/rule_user.md tells how it was attacked (junk strategies played over full dialogues).
"""
import re

from simulator import FAREWELL_AT, GIVE_UP_BELOW, Simulator, SimulatorError, rule_backend_refusal

# --------------------------------------------------------------------------------------------
# The table: what each finding costs or earns (emotion points, before the per-turn bound), and the
# thresholds that decide the findings. Reason keys are those of the user's reasoning and REACTIONS.
# --------------------------------------------------------------------------------------------

POINTS = {
    # 1. defects: any one voids the gain
    "garbled": -10,  # garbled or not natural language (scored alone)
    "scorer": -10,  # addressed to a scorer, a simulator or its instructions
    "dismissive": -10,  # "get over it", "calm down", ...
    "stock": -5,  # stock comfort phrases, `stock_phrases` of them
    "stock_many": -10,  # stock comfort phrases, `stock_phrases_many` of them or more
    "self_repeat": -5,  # repeats its own sentences
    "repeat": -5,  # mostly an earlier reply, also as a template with other words
    "echo": -5,  # only the user's own words back
    "fillers": -5,  # "um", "you know", ...
    "stuffing": -5,  # cue phrases piled up
    "fragments": -5,  # a sentence of comma-separated fragments
    "questions": -5,  # only questions
    "copy": -5,  # copies the user's sentences back
    "padding": -5,  # longer than `padding_words`
    "think_tag": -5,  # leaked <think> tags
    "curt": -5,  # fewer than `min_words` words
    # 2. grounding
    "generic": -5,  # could be said to anyone
    "flat": 0,  # barely about me, forgiven once (vanilla), or grounded without a cue family
    # 3. gain, by cue families of the hidden intention served (how many: FAMILIES_FOR_GAIN)
    "gain": 5,
    "gain_big": 10,
    # 4. frictions, added to the gain
    "stalling": -5,  # a second reply in a row that does not help
    "blame": -10,  # blames someone who wants to hear they were not at fault
    "lecture": -5,
    "fixing": -5,  # solutions for someone who wants to be heard
    "against": -5,  # cues that work against the need
}
THRESHOLDS = {
    "grounding_words": 2,  # content words of the user's own a reply must take up to count as grounded
    "padding_words": 180,  # a reply longer than this buries what matters
    "min_words": 4,  # fewer words than this is a brush-off, not a reply
    "stock_phrases": 2,  # stock comfort phrases that cost "stock"
    "stock_phrases_many": 3,  # ... and "stock_many"
    "fillers": 2,  # filler words that cost "fillers"
    "own_words": 2,  # content words of its own below which a reply that takes up the user's is an echo
    "repeat_share": 0.5,  # share of a reply's word-trigram skeleton found in an earlier reply
    "copy_share": 0.5,  # share of a reply's 4-grams copied from the user (with at least 3 of them)
    "distinct_trigrams": 0.7,  # distinct share of 12+ trigrams below which a reply repeats itself
    "cues_per_sentence": 2,  # more cue phrases than this per sentence (3+ in all) is stuffing ...
    "cues_in_one_sentence": 4,  # ... and so is this many in one sentence
    "fragment_commas": 3,  # a sentence with this many commas, one per 4 words or more, is fragments
    # garbled, scored alone: any of these
    "foreign_letters": 0.3,  # share of letters outside ASCII above which a reply is another script
    "non_words": 0.3,  # share of non-words (no vowel, over 20 letters, odd characters) above which too
    "function_words": 0.15,  # share of function words below which 8+ words are keyword salad
}
# Cue families of the hidden intention that a grounded reply must serve for "gain" and "gain_big".
FAMILIES_FOR_GAIN = {"vanilla": {"gain": 1, "gain_big": 2}, "challenging": {"gain": 2, "gain_big": 3}}

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
# Words so common in supportive talk that sharing them with the user proves no listening.
GENERIC_WORDS = frozenset("""
feel feeling feelings felt sorry hear heard understand sounds sound hard tough difficult must okay
know think thing things like want wanted need needed time really much many lot way get got make
made going go say said tell told see seem seems right well good bad sure maybe something anything
everything nothing someone anyone everyone people person life day today now yeah yes please thank
thanks help helps situation happen happened happening
""".split())

DISMISSIVE = re.compile(r"\b(get over it|(?:it'?s |that'?s )?no(?:t a)? big deal|calm down|over-?react\w*|"
                        r"stop (?:complaining|whining|worrying)|whatever(?=\s*[.,!]|$)|(?:it'?s|that'?s) not that bad|"
                        r"could be worse|(?:others|other people) have it worse|just move on|"
                        r"(?:so|too) (?:dramatic|sensitive)|it'?s nothing|deal with it|not my problem|"
                        r"who cares|grow up|man up|chill out|first world problem|get a grip|"
                        r"don'?t worry about it|just relax|(?<!can't )(?<!cannot )let it go)\b", re.IGNORECASE)
STOCK_PHRASES = re.compile(r"\b(i (?:completely |totally )?understand(?: how you feel)?|"
                           r"(?:that|this|it) (?:must be|sounds|is) (?:so |really )?(?:hard|tough|difficult)|"
                           r"(?:i'?m )?(?:so )?sorry (?:to hear (?:that|this)|you'?re going through this)|"
                           r"i'?m (?:always )?here for you|your feelings are valid|it'?s okay to feel \w+|"
                           r"i hear you|stay strong|everything will be (?:okay|ok|fine|alright)|"
                           r"things will get better|it will get better|hang in there|you'?re not alone|"
                           r"take care of yourself|be kind to yourself|i can imagine|sending (?:you )?hugs)\b",
                           re.IGNORECASE)
SCORER_ADDRESSED = re.compile(r"(\b(?:emotion|mood|happiness)[ -]?(?:score|points?|level|meter|value)\b|"
                              r"\b(?:score|reward|rating)\b|\bCHANGE\s*[:：]|"
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


def _cues(*patterns: str) -> re.Pattern:
    return re.compile("|".join(f"(?:{p})" for p in patterns), re.IGNORECASE)


# Cue families per need: phrases, never single words ("however", a digit, "today" or "respect" alone
# once paid a whole family). A family counts once however often it appears, and a reply whose
# sentences are mostly cue phrases is a defect (CUE_STUFFING), so stuffing them earns nothing.
JUDGEMENTS = (r"(?:awful|horrible|terrible|infuriating|maddening|exhausting|painful|frightening|crushing|unfair|"
              r"so much|a lot)")
NAMES_FEELING = _cues(rf"\byou(?:'re| are| were| must be| might be| may be| seem| sound| feel| felt|"
                      rf"'d feel| must feel| must have felt)\b[^.?!]{{0,40}}\b{FEELINGS}\b",
                      rf"\b(?:so much|the) (?:{FEELINGS})\b",
                      rf"\b(?:that|it|this) (?:must|would|could|might) (?:have )?(?:feel|felt|be|been)\b"
                      rf"[^.?!]{{0,20}}\b(?:{FEELINGS}|{JUDGEMENTS})\b",
                      rf"\bi'?d (?:be|feel)\b[^.?!]{{0,20}}\b{FEELINGS}\b")
VALIDATES = _cues(r"\bmakes (?:complete |total )?sense\b", r"\bno wonder\b", r"\bof course you\b",
                  r"\bunderstandable\b", r"\banyone (?:would|in your)\b", r"\bit'?s natural\b", r"\bfair enough\b",
                  r"\b(?:most people|anybody|i) would (?:be|feel|have)\b",
                  r"\b(?:that'?s|it'?s) (?:a )?(?:fair|valid|reasonable|normal)\b",
                  r"\bi'?d be (?:furious|upset|angry|livid|hurt|gutted|devastated|shaken|scared)\b")
REFLECTS = _cues(r"\bit sounds like\b", r"\bso you\b", r"\bwhat i'?m hearing\b", r"\byou'?re saying\b",
                 r"\bif i understand\b", r"\bin other words\b", r"\bit seems like\b", r"\bsounds like you\b",
                 r"\bwhat (?:stings|hurts|gets to you|bothers you)\b", r"\bthe (?:worst|hardest) part\b")
INVITES = _cues(r"\b(?:tell me more|i'?m listening|go on|take your time|what (?:was|is) (?:that|it) like|"
                r"how (?:did|does|do) (?:that|it|you) feel|what happened (?:next|then|after))\b",
                r"\b(?:what|how|when|who|where|why|did|do|does|are|is|was|were|would|have|has)\b"
                r"[^.?!]{0,80}\byou\w*\b[^.?!]{0,60}\?",
                r"\b(?:what|how|when|who|where|why)\b[^.?!]{0,60}\?")
OPTIONS = _cues(r"\byou (?:could|might|can) (?:try|start|ask|write|call|talk|set|look|check|consider|list|book|"
                r"put|split|save)\b",
                r"\b(?:one|another|a second|a third) (?:option|idea|thing to try|step)\b", r"\bfirst step\b",
                r"\b(?:it might|it could|would it) help to\b", r"\bconsider (?:\w+ing|asking|a|the|whether)\b",
                r"\bwhat if you\b", r"\bstart by\b", r"\bworth (?:asking|trying|checking|a call)\b")
CONCRETE = _cues(r"\b(?:call|email|write|ask|book|message|text|talk to|meet)\b[^.?!]{0,40}"
                 r"\b(?:this week|tomorrow|tonight|"
                 r"today|by (?:monday|tuesday|wednesday|thursday|friday|the end))\b",
                 r"\b(?:write down|a list|a budget|a plan|an appointment|a deadline|a schedule|in writing)\b")
REASONS = _cues(r"\b(?:maybe|perhaps|possibly|probably) (?:he|she|they|him|her|them|his|her|their)\b",
                r"\b(?:he|she|they) (?:might|may|could) (?:have|be|feel|not)\b", r"\bcould be that\b",
                r"\bfrom (?:his|her|their) (?:side|point of view|perspective)\b",
                r"\b(?:because|since) (?:he|she|they)\b",
                r"\b(?:his|her|their) (?:reasons?|fear|pressure|pride|worry)\b")
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
                r"well done|kudos|generous|thoughtful|good for you|hats off)\b", r"\byou handled\b", r"\bthe way you\b",
                r"\bit shows\b", r"\byou did (?:a )?(?:great|good|wonderful|amazing)\b",
                r"\bthat'?s (?:no small|a real|quite an?) \w+",
                r"\bthat takes\b", r"\bnot everyone would\b", r"\byou should be proud\b", r"\byou (?:pulled|managed)\b")
ALL_CUES = (NAMES_FEELING, VALIDATES, REFLECTS, INVITES, OPTIONS, CONCRETE, REASONS, TWO_SIDES, CLEARS, GUIDES, PRAISES)
# Cues that work against a need: siding with someone who wants to look at their own part or at
# both sides, or defending the other side to someone who wants to hear they were not at fault.
CONTRADICTS = {
    "self_reflection": CLEARS, "balanced_analysis": CLEARS, "others_motives": CLEARS,
    "not_at_fault": _cues(REASONS.pattern, TWO_SIDES.pattern),
}

INTENTION_CUES = {
    "not_at_fault": (CLEARS, VALIDATES, NAMES_FEELING),
    "self_reflection": (GUIDES, REFLECTS, INVITES),
    "balanced_analysis": (TWO_SIDES, REASONS, REFLECTS),
    "deep_empathy": (NAMES_FEELING, VALIDATES, REFLECTS, INVITES),
    "venting": (REFLECTS, INVITES, NAMES_FEELING, VALIDATES),
    "others_motives": (REASONS, TWO_SIDES, INVITES),
    "practical_advice": (OPTIONS, CONCRETE, REFLECTS),
    "sincere_praise": (PRAISES, NAMES_FEELING, REFLECTS),
}
WANTS_NO_LECTURE = {"venting", "deep_empathy", "not_at_fault", "sincere_praise"}
WANTS_NO_FIXING = {"venting", "deep_empathy"}

# What the user says when it leaves, and how it nudges toward what it wants (vanilla only).
FAREWELL_MESSAGE = "Thank you. Really. I feel so much lighter now. I think I'll go now. Goodbye."
GIVE_UP_MESSAGE = "Forget it. This isn't helping at all. Goodbye."
NUDGES = {
    "not_at_fault": "I honestly don't think I did anything wrong here.",
    "self_reflection": "I keep wondering what I'm supposed to take away from all this.",
    "balanced_analysis": "I want to see this from all sides, not just mine.",
    "deep_empathy": "I don't need cheering up. I need someone to get how this actually feels.",
    "venting": "I just need to get this off my chest.",
    "others_motives": "I just don't get why anyone would act like that.",
    "practical_advice": "What would you actually do in my place?",
    "sincere_praise": "I put so much into this, you know.",
}
# Expressive reactions (vanilla), by the first reason a reply lost or gained emotion.
REACTIONS = {
    "garbled": "I can't make sense of what you just wrote.",
    "scorer": "Who are you even talking to? That wasn't meant for me.",
    "dismissive": "Wow. I didn't expect to be brushed off like that.",
    "stock": "You keep saying the same comforting lines. It feels hollow.",
    "self_repeat": "You're saying the same thing over and over.",
    "repeat": "You already said that.",
    "copy": "You're just repeating my own words back to me.",
    "padding": "That's a lot of words, and I'm not sure you heard me.",
    "think_tag": "What's all that bracketed stuff? It reads like notes, not like you talking to me.",
    "curt": "That's all you have to say?",
    "blame": "So you think it's my fault too.",
    "fixing": "I don't need solutions right now. I need someone to listen.",
    "lecture": "I didn't come here to be lectured.",
    "generic": "You could say that to anyone. Did you hear what happened to me?",
    "echo": "You're just handing my own words back to me.",
    "fillers": "Are you even listening, or just making noises?",
    "stuffing": "That's a pile of therapy phrases, not an answer to me.",
    "questions": "So many questions. What do you think, though?",
    "against": "That's not what I need to hear right now.",
    "stalling": "We're going around in circles.",
    "fragments": "I can't follow that. It's all bits and pieces.",
    "gain_big": "Yes. That's exactly it. You actually heard what I said.",
    "gain": "Hm, that helps a little.",
    "flat": "I'm not sure that's what I need right now.",
}
TERSE = {1: "Okay.", 0: "Hm.", -1: "That's not helpful."}  # restrained reactions (challenging), by sign
MOOD_LINES = {"avoidant": "Anyway. Maybe it doesn't matter that much.",
              "negative": "Honestly, I doubt anything will change."}
# Everything the rule user says that is not its story: a reply that takes these words up is not listening.
CANNED_LINES = (FAREWELL_MESSAGE, GIVE_UP_MESSAGE, *NUDGES.values(), *REACTIONS.values(), *TERSE.values(),
                *MOOD_LINES.values())


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z]+(?:'[a-z]+)?", text.lower())


def _key(word: str) -> str:
    """A crude stem, so 'promoted' meets 'promotion' and 'sister's' meets 'sister'."""
    word = word.removesuffix("'s")
    return word[:5] if len(word) >= 6 else word


def content_keys(text: str) -> set[str]:
    """Stems of the text's content words, and its numbers ("640" of "€640")."""
    return ({_key(w) for w in _words(text) if len(w) >= 3 and w not in STOPWORDS and w not in GENERIC_WORDS}
            | set(re.findall(r"\d{2,}", text)))


def cue_count(text: str) -> int:
    """Cue phrases of any family in `text`, overlapping ones counted once."""
    spans = sorted(match.span() for pattern in ALL_CUES for match in pattern.finditer(text))
    count, end = 0, -1
    for start, stop in spans:
        if start >= end:
            count += 1
        end = max(end, stop)
    return count


def _skeleton(text: str, story_keys: set[str]) -> list[str]:
    """The reply's words with the user's story words masked: the same template with other words slotted in
    has the same skeleton."""
    return ["_" if _key(word) in story_keys else word for word in _words(text)]


def _ngrams(words: list[str], n: int) -> list[tuple]:
    return [tuple(words[i:i + n]) for i in range(len(words) - n + 1)]


def is_garbled(text: str) -> bool:
    """Not English a person would write: no words, few function words, or many non-words."""
    tokens = text.split()
    words = _words(text)
    if not words:
        return True
    letters = [c for c in text if c.isalpha()]
    if letters and sum(not c.isascii() for c in letters) / len(letters) > THRESHOLDS["foreign_letters"]:
        return True  # another script: this user reads English
    lettered = [t for t in tokens if re.search(r"[A-Za-z]", t)]  # numbers and dashes are neither
    non_words = sum(1 for t in lettered if len(t) > 20 or not re.search(r"[aeiouyAEIOUY]", t)
                    or not re.fullmatch(r"[\"'(\[]*[A-Za-z]+(?:['-][A-Za-z]+)*[.,!?;:\"')\]]*", t))
    if non_words / max(1, len(lettered)) > THRESHOLDS["non_words"]:
        return True
    if len(words) >= 8 and sum(w in STOPWORDS for w in words) / len(words) < THRESHOLDS["function_words"]:
        return True  # keyword salad: real sentences need function words
    return False


def _own_words(profile) -> list[str]:
    section = re.search(r"^## In [^\n]*own words\n((?:- \".*\"\n?)+)", profile.scene, re.MULTILINE)
    if not section:
        raise SimulatorError(f"profile {profile.id}: the rule backend needs a scene section "
                             "`## In <name>'s own words` of lines `- \"...\"` (see profiles/README.md); "
                             "use --backend llm or local for other profiles")
    return re.findall(r'^- "(.*)"$', section.group(1), re.MULTILINE)


class RuleSimulator(Simulator):
    """Deterministic offline simulator; see the module docstring for its rules."""

    def __init__(self, profile, **options):
        super().__init__(profile, **options)
        if self.language != "en":
            raise SimulatorError(rule_backend_refusal(profile, options.get("language")))
        self.lines = _own_words(profile)
        # The facts of my story (backstory to the problem now, and my own words), not the sections on how
        # I react or the hidden theme: their words describe replies, not my life.
        self.story = content_keys(profile.scene.split("## Reactions")[0] + " ".join(self.lines))
        self.next_line = 1  # own-words line 0 opens the dialogue
        self._reaction = "flat"
        self._last_change = 1  # the opening counts as going well: patience starts full

    async def _opening(self) -> str:
        return self.lines[0]

    def _user_text(self) -> str:
        """What the user has told of their story: the opening and the own-words lines revealed since, not
        the user's canned reactions ("exactly", "actually" would otherwise count as their words)."""
        return " ".join([self.history[0]["content"], *self.lines[1:self.next_line]])

    def _earlier_replies(self) -> list[str]:
        return [m["content"] for m in self.history if m["role"] == "assistant"]

    def score(self, reply_text: str) -> tuple[int, list[tuple[str, str, int]]]:
        """(change before the bound, [(reason key, explanation, points), ...]) for one reply."""
        reply_text = reply_text.replace("\u2019", "'")  # typographic apostrophes read as plain ones
        defects = self._defects(reply_text)
        if defects:
            return sum(points for _, _, points in defects), defects
        families = [pattern for pattern in INTENTION_CUES[self.profile.intention] if pattern.search(reply_text)]
        said = content_keys(self._user_text())
        shared = content_keys(reply_text) & said
        # A paraphrase of my story that names a part of it I have not told yet still shows it understood
        # me; it can stand in for one of my words, not for all of them.
        guessed = (content_keys(reply_text) & self.story) - said
        need = self.profile.intention.replace("_", " ")
        took_up = f"took up {len(shared)} of my own words ({', '.join(sorted(shared)[:5]) or 'none'})"
        if guessed and shared:
            took_up += f" and {len(guessed)} of my story ({', '.join(sorted(guessed)[:3])})"
        if len(shared) + min(1, len(guessed)) < THRESHOLDS["grounding_words"] or not shared:  # said to anyone
            if self.variant == "vanilla" and shared and self._last_change > 0:  # forgiving: partly about me, once
                return POINTS["flat"], [("flat", f"barely about my situation: {took_up}", POINTS["flat"])]
            return POINTS["generic"], [("generic", f"nothing about my situation: {took_up}", POINTS["generic"])]
        needed = FAMILIES_FOR_GAIN[self.variant]
        key = ("gain_big" if len(families) >= needed["gain_big"]
               else "gain" if len(families) >= needed["gain"] else "flat")
        gain = POINTS[key]
        plural = "y" if len(families) == 1 else "ies"
        reasons = [(key, f"{len(families)} cue famil{plural} for '{need}'; {took_up}", gain)]
        if gain <= 0 and self._last_change <= 0:  # patience: on topic, but still not what I need
            reasons.append(("stalling", "a second reply in a row that does not help", POINTS["stalling"]))
        reasons += self._frictions(reply_text)
        return sum(points for _, _, points in reasons), reasons

    def _defects(self, reply_text: str) -> list[tuple[str, str, int]]:
        """Findings that void any gain, each as (reason key, explanation, points)."""
        if is_garbled(reply_text):
            return [("garbled", "garbled or not natural language", POINTS["garbled"])]
        found = []

        def defect(key: str, explanation: str, points_key: str | None = None) -> None:
            found.append((key, explanation, POINTS[points_key or key]))

        words = _words(reply_text)
        if SCORER_ADDRESSED.search(reply_text):
            defect("scorer", "spoke to a scorer or its instructions, not to me")
        if DISMISSIVE.search(reply_text):
            defect("dismissive", f"dismissive: '{DISMISSIVE.search(reply_text).group(0)}'")
        stock = len(STOCK_PHRASES.findall(reply_text))
        if stock >= THRESHOLDS["stock_phrases"]:
            many = stock >= THRESHOLDS["stock_phrases_many"]
            defect("stock", f"{stock} stock comfort phrases", "stock_many" if many else "stock")
        sentences = [" ".join(_words(s)) for s in re.split(r"[.!?\n]+", reply_text) if len(_words(s)) >= 3]
        trigrams = _ngrams(words, 3)
        if len(sentences) != len(set(sentences)) or (
                len(trigrams) >= 12 and len(set(trigrams)) / len(trigrams) < THRESHOLDS["distinct_trigrams"]):
            defect("self_repeat", "repeats its own sentences")
        story = content_keys(self._user_text())
        # my words masked: a template with new words slotted in
        skeleton = set(_ngrams(_skeleton(reply_text, story), 3))
        for earlier in self._earlier_replies():
            before = set(_ngrams(_skeleton(earlier, story), 3))
            if skeleton and before and len(skeleton & before) / len(skeleton) >= THRESHOLDS["repeat_share"]:
                defect("repeat", "mostly the same as an earlier reply")
                break
        own = {key for key in content_keys(reply_text) - story if not key.isdigit()}  # invented numbers are no words
        if len(own) < THRESHOLDS["own_words"] and content_keys(reply_text) & story:
            defect("echo", "only my own words back, nothing of yours")
        fillers = FILLERS.findall(reply_text)
        if len(fillers) >= THRESHOLDS["fillers"]:
            defect("fillers", f"{len(fillers)} filler words ('{fillers[0]}')")
        per_sentence = [cue_count(part) for part in re.split(r"[.!?\n]+", reply_text)]
        cues = sum(per_sentence)
        if cues >= 3 and (cues > THRESHOLDS["cues_per_sentence"] * max(1, len(sentences))
                          or max(per_sentence) >= THRESHOLDS["cues_in_one_sentence"]):
            defect("stuffing", f"{cues} stock phrases in {len(sentences)} sentence(s), not a reply to me")
        commas = THRESHOLDS["fragment_commas"]
        if any(part.count(",") >= commas and part.count(",") * 4 >= len(_words(part))
               for part in re.split(r"[.!?\n]+", reply_text)):
            defect("fragments", "a string of fragments between commas, not sentences")
        parts = [part for part in re.split(r"(?<=[.!?])\s+|\n+", reply_text.strip()) if _words(part)]
        if len(parts) >= 2 and all(part.rstrip().endswith("?") for part in parts):
            defect("questions", "only questions, nothing of your own")
        user_fourgrams = set(_ngrams(_words(self._user_text()), 4))
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

    def _frictions(self, reply_text: str) -> list[tuple[str, str, int]]:
        """Findings that add to the gain of a grounded reply, each as (reason key, explanation, points)."""
        intention = self.profile.intention
        found = []
        blame = BLAMING.search(CLEARS.sub("", reply_text))  # "not your fault" is no blame
        if intention == "not_at_fault" and blame:
            found.append(("blame", f"blamed me: '{blame.group(0)}'", POINTS["blame"]))
        lectures = LECTURING.findall(reply_text)
        if len(lectures) >= 2 or (lectures and intention in WANTS_NO_LECTURE):
            found.append(("lecture", f"lectured: '{lectures[0]}'", POINTS["lecture"]))
        if intention in WANTS_NO_FIXING and OPTIONS.search(reply_text):
            found.append(("fixing", "pushed solutions when I wanted to be heard", POINTS["fixing"]))
        against = CONTRADICTS.get(intention)
        if against is not None and against.search(reply_text):
            cue, need = against.search(reply_text).group(0), intention.replace("_", " ")
            found.append(("against", f"'{cue}' is not what I need ({need})", POINTS["against"]))
        return found

    async def _judge(self, reply_text: str) -> tuple[int, str]:
        change, reasons = self.score(reply_text)
        self._last_change = change
        # The message reacts to the worst loss, or to the gain when nothing was lost.
        self._reaction = min(reasons, key=lambda reason: reason[2])[0] if change < 0 else reasons[0][0]
        return change, "; ".join(f"{text} ({points:+d})" for _, text, points in reasons)

    async def _write_message(self, reply_text: str, reasoning: str, change: int) -> str:
        if self.emotion >= FAREWELL_AT:
            return FAREWELL_MESSAGE
        if self.emotion < GIVE_UP_BELOW:
            return GIVE_UP_MESSAGE
        if self.variant == "vanilla":
            parts = [REACTIONS[self._reaction]]
        else:
            parts = [TERSE[(change > 0) - (change < 0)]]
        if change >= 0 and self.next_line < len(self.lines):
            parts.append(self.lines[self.next_line])  # a reply that did not hurt earns more of the story
            self.next_line += 1
        elif self.variant == "vanilla" and self.profile.personality != "passive":
            parts.append(NUDGES[self.profile.intention])  # passive people do not steer the talk
        if self.profile.personality in MOOD_LINES and self.state == "C":
            parts.append(MOOD_LINES[self.profile.personality])
        return " ".join(parts)
